// "Machines" for launcher tests: Linux network namespaces joined through a
// bridge in a switch namespace, made and removed by the test itself.
//
//   namespace coh_el_<pid>_n<i>  eth0 = 10.81.0.<i+1>/24, lo up
//   namespace coh_el_<pid>_sw    bridge br0 with one veth peer per machine
//
// Every interface is created directly inside its namespace, so nothing
// appears in (or sends traffic on) the host's network. cut(i) takes machine
// i's eth0 down, as a pulled cable would; restore(i) brings it back.
// Needs root and iproute2; make() says why when it cannot, and tests skip with
// that message.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace netns_test {

inline bool sh(const std::string& cmd) {
  return std::system((cmd + " >/dev/null 2>&1").c_str()) == 0;
}

inline std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

class Lab {
 public:
  Lab() : tag_("coh_el_" + std::to_string(getpid())) {}
  ~Lab() { remove(); }
  Lab(const Lab&) = delete;
  Lab& operator=(const Lab&) = delete;

  // Makes n machines; false with `why` set when this host cannot.
  bool make(int n, std::string* why) {
    if (geteuid() != 0) return fail(why, "needs root to create network namespaces (run the tests as root)");
    if (!sh("ip -V")) return fail(why, "needs the `ip` command (iproute2)");
    if (!sh("ip netns add " + sw())) return fail(why, "cannot create a network namespace (ip netns add failed)");
    made_.push_back(sw());
    if (!sh("ip -n " + sw() + " link add br0 type bridge") || !sh("ip -n " + sw() + " link set br0 up"))
      return fail(why, "cannot create a bridge inside the switch namespace");
    for (int i = 0; i < n; ++i) {
      const std::string ns = name(i), port = "p" + std::to_string(i);
      if (!sh("ip netns add " + ns)) return fail(why, "cannot create namespace " + ns);
      made_.push_back(ns);
      bool ok = sh("ip link add eth0 netns " + ns + " type veth peer name " + port + " netns " + sw()) &&
                sh("ip -n " + sw() + " link set " + port + " master br0") &&
                sh("ip -n " + sw() + " link set " + port + " up") &&
                sh("ip -n " + ns + " addr add " + addr(i) + "/24 dev eth0") &&
                sh("ip -n " + ns + " link set eth0 up") && sh("ip -n " + ns + " link set lo up");
      if (!ok) return fail(why, "cannot connect namespace " + ns + " with a veth pair to the bridge");
    }
    // The bridge forwards once its ports are up; wait (bounded) until machine 0 reaches the others.
    for (int i = 1; i < n; ++i)
      for (int t = 0; t < 50 && !sh("ip netns exec " + name(0) + " ping -c1 -W1 " + addr(i)); ++t)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    return true;
  }

  void remove() {
    for (auto it = made_.rbegin(); it != made_.rend(); ++it) sh("ip netns del " + *it);
    made_.clear();
  }

  std::string name(int i) const { return tag_ + "_n" + std::to_string(i); }
  static std::string addr(int i) { return "10.81.0." + std::to_string(i + 1); }
  bool cut(int i) { return sh("ip -n " + name(i) + " link set eth0 down"); }
  bool restore(int i) { return sh("ip -n " + name(i) + " link set eth0 up"); }

 private:
  std::string sw() const { return tag_ + "_sw"; }
  bool fail(std::string* why, const std::string& text) {
    *why = text;
    remove();
    return false;
  }
  std::string tag_;
  std::vector<std::string> made_;
};

// A process started inside machine i (`ip netns exec`, which execs the
// command, so pid() is the command's own pid), output to files.
class NsProc {
 public:
  NsProc(const std::string& ns, const std::vector<std::string>& cmd, const std::vector<std::string>& env,
         const std::string& log_prefix)
      : out_path_(log_prefix + ".out"), err_path_(log_prefix + ".err") {
    std::vector<std::string> argv = {"ip", "netns", "exec", ns, "env"};
    argv.insert(argv.end(), env.begin(), env.end());
    argv.insert(argv.end(), cmd.begin(), cmd.end());
    pid_ = fork();
    if (pid_ == 0) {
      if (!freopen(out_path_.c_str(), "w", stdout) || !freopen(err_path_.c_str(), "w", stderr)) _exit(127);
      std::vector<char*> a;
      for (auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
      a.push_back(nullptr);
      execvp("ip", a.data());
      _exit(127);
    }
  }
  ~NsProc() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }
  std::string out() const { return slurp(out_path_); }
  std::string err() const { return slurp(err_path_); }

  // Exit code, 128+signal, or -1 when still running after timeout_s (then SIGKILLed).
  int wait(double timeout_s) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<long>(timeout_s * 1000));
    int status = 0;
    pid_t r;
    while ((r = waitpid(pid_, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    reaped_ = true;
    if (r == 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
      return -1;
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

  // Waits (bounded) until stderr contains `text`.
  bool wait_err(const std::string& text, double timeout_s = 60) const {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<long>(timeout_s * 1000));
    while (err().find(text) == std::string::npos) {
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return true;
  }

 private:
  std::string out_path_, err_path_;
  pid_t pid_ = -1;
  bool reaped_ = false;
};

}  // namespace netns_test
