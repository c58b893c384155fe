// Test harness for the launcher: runs the real `cohort` binary (COHORT_BIN) as
// a child process, captures its stdout and stderr, and bounds every wait with a
// generous deadline so a broken launcher fails the test instead of hanging it.
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace launch_test {

using Clock = std::chrono::steady_clock;

inline std::string prog(const std::string& name) { return std::string(COHORT_TEST_BIN_DIR) + "/" + name; }

struct Result {
  int status = -1;  // exit code, or 128+signal; -1 when the deadline passed (then it was SIGKILLed)
  std::string out, err;
  double seconds = 0;
};

// A running `cohort` process with its output pipes.
class Proc {
 public:
  // env: overrides on top of ours ("" value: unset). OMP_NUM_THREADS is unset
  // unless given, and COHORT_TERM_TIMEOUT defaults to 2s so stops are quick.
  Proc(const std::vector<std::string>& args, std::map<std::string, std::string> env = {}) {
    std::vector<std::string> argv{COHORT_BIN};
    argv.insert(argv.end(), args.begin(), args.end());
    env.emplace("OMP_NUM_THREADS", "");
    env.emplace("COHORT_TERM_TIMEOUT", "2s");
    std::vector<std::string> envs;
    for (char** e = environ; *e != nullptr; ++e) {
      std::string kv = *e;
      if (env.count(kv.substr(0, kv.find('='))) == 0) envs.push_back(kv);
    }
    for (const auto& [k, v] : env)
      if (!v.empty()) envs.push_back(k + "=" + v);
    int out[2], err[2];
    if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0) std::abort();
    start_ = Clock::now();
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], 1);
      dup2(err[1], 2);
      std::vector<char*> a, e;
      for (auto& s : argv) a.push_back(s.data());
      a.push_back(nullptr);
      for (auto& s : envs) e.push_back(s.data());
      e.push_back(nullptr);
      execve(argv[0].c_str(), a.data(), e.data());
      _exit(127);
    }
    close(out[1]);
    close(err[1]);
    fd_[0] = out[0];
    fd_[1] = err[0];
  }
  ~Proc() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    for (int fd : fd_)
      if (fd >= 0) close(fd);
  }
  pid_t pid() const { return pid_; }

  // Reads output until the process exits and its pipes close, or timeout_s.
  Result wait(double timeout_s = 60) {
    auto deadline = start_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
    std::string* sink[2] = {&result_.out, &result_.err};
    while (fd_[0] >= 0 || fd_[1] >= 0) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) break;
      pollfd p[2];
      int n = 0, which[2];
      for (int i = 0; i < 2; ++i)
        if (fd_[i] >= 0) {
          p[n] = {fd_[i], POLLIN, 0};
          which[n++] = i;
        }
      if (poll(p, n, static_cast<int>(left)) <= 0) continue;
      for (int j = 0; j < n; ++j) {
        if (p[j].revents == 0) continue;
        char buf[4096];
        ssize_t r = read(fd_[which[j]], buf, sizeof(buf));
        if (r > 0) {
          sink[which[j]]->append(buf, static_cast<size_t>(r));
        } else {
          close(fd_[which[j]]);
          fd_[which[j]] = -1;
        }
      }
    }
    int status = 0;
    pid_t r;
    while ((r = waitpid(pid_, &status, WNOHANG)) == 0 && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (r == 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
      result_.status = -1;
    } else {
      result_.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    reaped_ = true;
    result_.seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    return result_;
  }

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
  int fd_[2] = {-1, -1};
  Clock::time_point start_;
  Result result_;
};

inline Result run(const std::vector<std::string>& args, std::map<std::string, std::string> env = {},
                  double timeout_s = 60) {
  return Proc(args, std::move(env)).wait(timeout_s);
}

// A fresh empty directory under the system temp dir.
inline std::string temp_dir() {
  std::string t = (std::filesystem::temp_directory_path() / "cohort_launch_test_XXXXXX").string();
  if (mkdtemp(t.data()) == nullptr) std::abort();
  return t;
}

// Waits (up to timeout_s) for DIR/<rank>.pid for every rank; returns the pids (empty on timeout).
inline std::vector<pid_t> wait_pid_files(const std::string& dir, int n, double timeout_s = 30) {
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  while (Clock::now() < deadline) {
    std::vector<pid_t> pids;
    for (int r = 0; r < n; ++r) {
      std::ifstream f(dir + "/" + std::to_string(r) + ".pid");
      long pid = 0;
      if (f >> pid) pids.push_back(static_cast<pid_t>(pid));
    }
    if (static_cast<int>(pids.size()) == n) return pids;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return {};
}

// Waits (up to timeout_s) for `path` to exist, as a running job writes it (a
// checkpoint's manifest, before a test signals the job); false on timeout.
inline bool wait_for_file(const std::string& path, double timeout_s = 120) {
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  while (!std::filesystem::exists(path)) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// True when pid is gone or a zombie nobody reaps (an init in a container may not).
inline bool process_gone(pid_t pid) {
  if (kill(pid, 0) != 0) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  auto close = line.rfind(')');
  return close == std::string::npos || (close + 2 < line.size() && line[close + 2] == 'Z');
}

inline bool wait_gone(pid_t pid, double timeout_s = 20) {
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  while (!process_gone(pid)) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return true;
}

// A port p such that p and p+1 were both free a moment ago (for --master-port,
// whose +1 the launcher's store takes).
// Two consecutive free loopback ports, below Linux's ephemeral range
// (32768-60999): a port the kernel hands out for outgoing connections could be
// taken by some process's connect() between this check and the launcher's bind.
inline int free_port_pair() {
  static unsigned seed = static_cast<unsigned>(::getpid()) * 2654435761u;
  for (int attempt = 0; attempt < 200; ++attempt) {
    int fds[2] = {-1, -1};
    seed = seed * 1103515245u + 12345u;
    const int base = 20000 + static_cast<int>((seed >> 8) % 12000);
    bool ok = true;
    for (int i = 0; i < 2 && ok; ++i) {
      fds[i] = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(static_cast<uint16_t>(base + i));
      ok = bind(fds[i], reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    }
    for (int fd : fds)
      if (fd >= 0) close(fd);
    if (ok && base > 0 && base < 65000) return base;
  }
  return 0;
}

// Lines of `text` that start with prefix, with the prefix removed.
inline std::vector<std::string> lines_with(const std::string& text, const std::string& prefix) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    std::string line = text.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
    if (line.compare(0, prefix.size(), prefix) == 0) out.push_back(line.substr(prefix.size()));
    if (nl == std::string::npos) break;
    pos = nl + 1;
  }
  return out;
}

}  // namespace launch_test
