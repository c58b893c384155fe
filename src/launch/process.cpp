#include "launch/process.hpp"

#include <fcntl.h>
#include <sched.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "cohort/error.hpp"
#include "core/check.hpp"
#include "core/cpu_list.hpp"
#include "core/fd.hpp"

namespace cohort::launch {
namespace {

sigset_t launcher_signals() {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGQUIT}) sigaddset(&set, sig);
  return set;
}

}  // namespace

SignalChannel::SignalChannel() {
  sigset_t set = launcher_signals();
  COHORT_ASSERT(pthread_sigmask(SIG_BLOCK, &set, &original_mask_) == 0, "pthread_sigmask failed");
  fd_.reset(signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC));
  if (!fd_.valid()) {
    int err = errno;
    pthread_sigmask(SIG_SETMASK, &original_mask_, nullptr);
    throw IoError(fmt::format("cohort run: signalfd failed: {}", std::strerror(err)));
  }
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  sigaction(SIGPIPE, &ignore, &original_pipe_);
}

SignalChannel::~SignalChannel() {
  sigaction(SIGPIPE, &original_pipe_, nullptr);
  fd_.reset();
  // Signals that arrived but were not read stay pending and fire once unblocked,
  // which is what the caller would want for a late SIGINT.
  pthread_sigmask(SIG_SETMASK, &original_mask_, nullptr);
}

std::vector<int> SignalChannel::drain() {
  std::vector<int> sigs;
  signalfd_siginfo info[16];
  for (;;) {
    ssize_t n = read(fd_.get(), info, sizeof(info));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    for (size_t i = 0; i < static_cast<size_t>(n) / sizeof(signalfd_siginfo); ++i)
      sigs.push_back(static_cast<int>(info[i].ssi_signo));
  }
  return sigs;
}

int SignalChannel::wait_stop_signal(int timeout_ms) {
  pollfd p{fd_.get(), POLLIN, 0};
  int rc = poll(&p, 1, timeout_ms);
  if (rc <= 0) return 0;
  for (int sig : drain())
    if (is_stop_signal(sig)) return sig;
  return 0;
}

bool is_stop_signal(int sig) { return sig == SIGINT || sig == SIGTERM || sig == SIGHUP || sig == SIGQUIT; }

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev != nullptr ? fmt::format("SIG{}", abbrev) : fmt::format("signal {}", sig);
}

pid_t spawn_worker(const SpawnRequest& req) {
  // Everything the child touches is prepared here: between fork and exec only
  // async-signal-safe calls are allowed (the launcher has other threads).
  std::vector<char*> argv, envp;
  for (const auto& a : req.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& e : req.env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  const core::Fd devnull(open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (!devnull.valid()) throw IoError(fmt::format("cohort run: cannot open /dev/null: {}", std::strerror(errno)));
  // The child writes {stage, errno} here when exec fails; a successful exec closes its end.
  int ends[2];
  if (pipe2(ends, O_CLOEXEC) != 0) throw IoError(fmt::format("cohort run: pipe failed: {}", std::strerror(errno)));
  core::Fd status_r(ends[0]), status_w(ends[1]);
  const pid_t launcher = getpid();
  cpu_set_t cpus;  // built here: CPU_SET is not promised to be async-signal-safe
  CPU_ZERO(&cpus);
  for (int c : req.cpus)
    if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &cpus);
  const bool pin = !req.cpus.empty();

  pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != launcher) _exit(127);  // the launcher died before prctl took effect
    dup2(devnull.get(), STDIN_FILENO);
    dup2(req.stdout_fd, STDOUT_FILENO);
    dup2(req.stderr_fd, STDERR_FILENO);
    // Descriptors the launcher did not mark close-on-exec (its store sockets, a
    // caller's) must not leak into the worker.
    close_range(3, ~0U, CLOSE_RANGE_CLOEXEC);
    signal(SIGPIPE, SIG_DFL);
    if (req.signal_mask != nullptr) sigprocmask(SIG_SETMASK, req.signal_mask, nullptr);
    int status[2] = {0, 0};  // {stage, errno}: 1 = pinning, 2 = exec
    if (pin && sched_setaffinity(0, sizeof(cpus), &cpus) != 0) {
      status[0] = 1;
    } else {
      execve(req.path.c_str(), argv.data(), envp.data());
      status[0] = 2;
    }
    status[1] = errno;
    ssize_t ignored = write(status_w.get(), status, sizeof(status));
    (void)ignored;
    _exit(127);
  }
  int fork_errno = errno;
  status_w.reset();  // only the child's copy stays open: EOF once it execs or exits
  if (pid < 0) {
    throw IoError(fmt::format("cohort run: fork failed: {}; the machine may be out of processes or memory",
                              std::strerror(fork_errno)));
  }
  setpgid(pid, pid);  // also here, so the group exists before we might signal it (EACCES after exec is fine)
  int child_status[2] = {0, 0};
  ssize_t n;
  do {
    n = read(status_r.get(), child_status, sizeof(child_status));
  } while (n < 0 && errno == EINTR);
  status_r.reset();
  if (n == static_cast<ssize_t>(sizeof(child_status))) {
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (child_status[0] == 1)
      throw IoError(fmt::format("cohort run: cannot pin {} to CPUs {} (--bind): sched_setaffinity: {}; the CPUs may "
                                "be outside this container's cpuset: run without --bind",
                                req.path, core::cpu_list_text(req.cpus), std::strerror(child_status[1])));
    throw IoError(fmt::format("cohort run: cannot start {}: {}; check that it is an executable for this machine",
                              req.path, std::strerror(child_status[1])));
  }
  return pid;
}

void signal_group(pid_t pgid, int sig) {
  if (pgid <= 0) return;  // never kill(0) or kill(-1)
  kill(-pgid, sig);
}

}  // namespace cohort::launch
