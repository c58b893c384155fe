// Helpers for tests that start real processes.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
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
// Everything the child needs is built before fork(): between fork and exec a
// child of a multithreaded parent (progress threads, CUDA, autograd) may call
// only async-signal-safe functions, so no setenv, malloc or stdio there.
inline Proc spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                  const std::string& log_prefix) {
  Proc p;
  p.out_path = log_prefix + ".out";
  p.err_path = log_prefix + ".err";
  std::vector<std::string> vars;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv(*e);
    if (env.count(kv.substr(0, kv.find('='))) == 0) vars.push_back(std::move(kv));
  }
  for (const auto& [k, v] : env) vars.push_back(k + "=" + v);
  std::vector<char*> args, envp;
  for (const auto& s : argv) args.push_back(const_cast<char*>(s.c_str()));
  args.push_back(nullptr);
  for (auto& s : vars) envp.push_back(s.data());
  envp.push_back(nullptr);
  const int out = ::open(p.out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const int err = ::open(p.err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  p.pid = fork();
  if (p.pid == 0) {
    if (out < 0 || err < 0 || dup2(out, STDOUT_FILENO) < 0 || dup2(err, STDERR_FILENO) < 0) _exit(127);
    execve(args[0], args.data(), envp.data());
    _exit(127);
  }
  if (out >= 0) ::close(out);
  if (err >= 0) ::close(err);
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
