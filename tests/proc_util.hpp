// Helpers for tests that start real processes.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace cohort::testing {

struct Proc {
  pid_t pid = -1;
  std::string out_path, err_path;
  int status = -1;
  bool exited = false;
  double exit_time_s = 0;  // since the start of wait_all

  std::string err() const {
    std::ifstream f(err_path);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  std::string out() const {
    std::ifstream f(out_path);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  int exit_code() const { return WIFEXITED(status) ? WEXITSTATUS(status) : -1; }
  int term_signal() const { return WIFSIGNALED(status) ? WTERMSIG(status) : 0; }
};

// Starts argv with extra environment variables, stdout/stderr to files.
inline Proc spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                  const std::string& log_prefix) {
  Proc p;
  p.out_path = log_prefix + ".out";
  p.err_path = log_prefix + ".err";
  p.pid = fork();
  if (p.pid == 0) {
    for (auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    if (!freopen(p.out_path.c_str(), "w", stdout) || !freopen(p.err_path.c_str(), "w", stderr)) _exit(127);
    std::vector<char*> a;
    for (auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
    a.push_back(nullptr);
    execv(a[0], a.data());
    _exit(127);
  }
  return p;
}

// Waits for every process, up to `limit`; kills (SIGKILL) whatever is left.
// Returns false if something had to be killed.
inline bool wait_all(std::vector<Proc>& ps, std::chrono::seconds limit) {
  auto t0 = std::chrono::steady_clock::now();
  size_t left = ps.size();
  while (left > 0) {
    for (auto& p : ps) {
      if (p.exited) continue;
      if (waitpid(p.pid, &p.status, WNOHANG) == p.pid) {
        p.exited = true;
        p.exit_time_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        --left;
      }
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() - t0 > limit) {
      for (auto& p : ps)
        if (!p.exited) {
          kill(p.pid, SIGKILL);
          waitpid(p.pid, &p.status, 0);
          p.exited = true;
        }
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

// A port that was free a moment ago (bound to port 0, then closed): the kernel
// does not hand it out again at once, unlike a guessed number, which another
// test running at the same time may already use.
inline int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

}  // namespace cohort::testing
