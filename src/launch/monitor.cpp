#include "launch/monitor.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "cohort/error.hpp"
#include "cohort/stop_signal.hpp"
#include "core/clock.hpp"
#include "core/fd.hpp"
#include "core/log.hpp"

namespace cohort::launch {

std::string describe_exit(const WorkerExit& e) {
  if (e.signal != 0) return fmt::format("was killed by signal {} ({})", e.signal, signal_name(e.signal));
  return fmt::format("exited with code {}", e.exit_code);
}

namespace {

using core::Clock;
using Outcome = AttemptResult::Outcome;

// A poll timeout that caps every sleep, so a lost wake-up costs a second, not a hang.
constexpr int kMaxSleepMs = 1000;
constexpr int kFailureGraceMs = 100;
// While a console is congested, how often to look whether it caught up.
constexpr std::chrono::milliseconds kCongestedPoll{20};
// After a stop signal, how long a congested console may hold the workers' output back.
constexpr std::chrono::milliseconds kOutputAfterStop{2000};

// True if process group `pgid` has a member that is not a zombie. kill(-pgid, 0)
// alone counts zombies too, and in a container whose init does not reap,
// orphaned zombies linger; they need no signal.
bool group_has_live_members(pid_t pgid) {
  if (::kill(-pgid, 0) != 0 && errno != EPERM) return false;  // no member at all
  DIR* proc = ::opendir("/proc");
  if (proc == nullptr) return true;
  bool live = false;
  while (dirent* e = ::readdir(proc)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    std::ifstream f(fmt::format("/proc/{}/stat", e->d_name));
    std::string stat;
    std::getline(f, stat);
    const size_t close = stat.rfind(')');  // the command name may contain spaces and parentheses
    if (close == std::string::npos) continue;
    char state = 0;
    long ppid = 0, pgrp = 0;
    if (std::sscanf(stat.c_str() + close + 1, " %c %ld %ld", &state, &ppid, &pgrp) == 3 && pgrp == pgid &&
        state != 'Z' && state != 'X') {
      live = true;
      break;
    }
  }
  ::closedir(proc);
  return live;
}

struct Worker {
  WorkerPlan* plan = nullptr;
  pid_t pid = -1;
  bool running = false;
  core::Fd pipe_fd[2];                      // read ends: stdout, stderr
  std::unique_ptr<StreamSink> sink[2];
};

class Monitor {
 public:
  Monitor(std::vector<WorkerPlan>& plans, const MonitorOptions& opts) : opts_(opts) {
    workers_.resize(plans.size());
    for (size_t i = 0; i < plans.size(); ++i) workers_[i].plan = &plans[i];
  }

  AttemptResult run() {
    std::exception_ptr setup_error;
    try {
      open_sinks();
      for (auto& w : workers_) start(w);
    } catch (...) {
      setup_error = std::current_exception();
      begin_stop(Clock::now());
    }
    loop();
    if (setup_error) std::rethrow_exception(setup_error);
    return result_;
  }

 private:
  void open_sinks() {
    for (auto& w : workers_) {
      const WorkerPlan& p = *w.plan;
      std::string prefix = fmt::format("[rank{}]: ", p.global_rank);
      w.sink[0] = std::make_unique<StreamSink>(p.route.console_out ? STDOUT_FILENO : -1, prefix,
                                               p.route.file_out ? p.log_dir + "/stdout.log" : "");
      w.sink[1] = std::make_unique<StreamSink>(p.route.console_err ? STDERR_FILENO : -1, prefix,
                                               p.route.file_err ? p.log_dir + "/stderr.log" : "");
    }
  }

  void start(Worker& w) {
    // The write ends are the child's; the parent's copies close when this returns or throws.
    int ends[2];
    if (pipe2(ends, O_CLOEXEC) != 0) throw IoError(fmt::format("cohort run: pipe failed: {}", std::strerror(errno)));
    core::Fd out_r(ends[0]), out_w(ends[1]);
    if (pipe2(ends, O_CLOEXEC) != 0) throw IoError(fmt::format("cohort run: pipe failed: {}", std::strerror(errno)));
    core::Fd err_r(ends[0]), err_w(ends[1]);
    SpawnRequest req = w.plan->spawn;
    req.stdout_fd = out_w.get();
    req.stderr_fd = err_w.get();
    req.signal_mask = &opts_.signals->original_mask();
    const pid_t pid = spawn_worker(req);
    w.pipe_fd[0] = std::move(out_r);
    w.pipe_fd[1] = std::move(err_r);
    for (const core::Fd& fd : w.pipe_fd) fcntl(fd.get(), F_SETFL, fcntl(fd.get(), F_GETFL) | O_NONBLOCK);
    w.pid = pid;
    w.running = true;
    COHORT_INFO(kLaunch, "started rank {} (local {}) as pid {}: {}", w.plan->global_rank, w.plan->local_rank, pid,
                fmt::join(req.argv, " "));
  }

  // Stops every worker: SIGTERM now, SIGKILL at kill_at_. The groups of workers
  // that already exited are signalled too, for children they left behind (a
  // group id is not reused while the group has members). After a worker's
  // failure each running worker first gets a SIGTERM queued with
  // kStopAfterFailure: a cohort::StopSignal then ends it at once instead of
  // stopping at an agreed step, which the failed rank cannot reach.
  void begin_stop(Clock::time_point now, bool after_failure = false) {
    if (stopping_) return;
    stopping_ = true;
    for (auto& w : workers_) {
      if (w.running) ++result_.stopped;
      if (after_failure && w.running && w.pid > 0) sigqueue(w.pid, SIGTERM, sigval{.sival_int = kStopAfterFailure});
      if (w.pid > 0) signal_group(w.pid, SIGTERM);
    }
    kill_at_ = now + opts_.term_timeout;
    COHORT_INFO(kLaunch, "sent SIGTERM to {} running worker(s); SIGKILL in {} ms", result_.stopped,
                opts_.term_timeout.count());
  }

  // True if a worker's process group still has a live member (the worker
  // itself or what it started).
  bool any_group_alive() const {
    return std::any_of(workers_.begin(), workers_.end(),
                       [](const Worker& w) { return w.pid > 0 && group_has_live_members(w.pid); });
  }

  void kill_all(Clock::time_point now) {
    for (auto& w : workers_)
      if (w.pid > 0) signal_group(w.pid, SIGKILL);
    killed_ = true;
    give_up_at_ = now + opts_.kill_wait;
  }

  // Reaps every worker that exited. A failure by exit code waits up to
  // kFailureGraceMs for a worker killed by a signal, which is then named
  // instead: it is the likely cause, the other exited because its collective
  // saw it die (with single copy that takes microseconds, and the victim may
  // become reapable only after its peer noticed).
  void reap(Clock::time_point now) {
    for (auto& w : workers_) {
      if (!w.running) continue;
      int status = 0;
      pid_t r = waitpid(w.pid, &status, WNOHANG);
      if (r == 0 || (r < 0 && errno == EINTR)) continue;
      w.running = false;
      if (r < 0) continue;  // not our child any more: nothing to report
      WorkerExit e{w.plan->local_rank, w.plan->global_rank, w.pid, 0, 0, ""};
      if (WIFEXITED(status)) e.exit_code = WEXITSTATUS(status);
      if (WIFSIGNALED(status)) e.signal = WTERMSIG(status);
      COHORT_INFO(kLaunch, "rank {} (local {}, pid {}) {}", e.global_rank, e.local_rank, e.pid, describe_exit(e));
      if ((e.exit_code == 0 && e.signal == 0) || stopping_) continue;
      if (pending_ == nullptr) pending_until_ = now + std::chrono::milliseconds(kFailureGraceMs);
      if (pending_ == nullptr || (e.signal != 0 && pending_exit_.signal == 0)) {
        pending_ = &w;
        pending_exit_ = e;
      }
    }
    if (pending_ == nullptr) return;
    const bool others_running = std::any_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.running; });
    if (pending_exit_.signal == 0 && others_running && now < pending_until_) return;
    if (!pending_->sink[1]->to_console()) pending_exit_.stderr_log = pending_->sink[1]->log_path();
    result_.outcome = Outcome::WorkerFailed;
    result_.failure = pending_exit_;
    pending_ = nullptr;
    if (opts_.on_local_failure) opts_.on_local_failure(*result_.failure);
    begin_stop(now, /*after_failure=*/true);
  }
  Worker* pending_ = nullptr;  // a failure by exit code, named once the grace has passed
  WorkerExit pending_exit_{};
  Clock::time_point pending_until_{};

  void on_signals() {
    for (int sig : opts_.signals->drain()) {
      if (!is_stop_signal(sig)) continue;  // SIGCHLD: reap() runs every turn
      COHORT_INFO(kLaunch, "received {}", signal_name(sig));
      if (result_.signal == 0) {
        result_.signal = sig;
        signalled_at_ = Clock::now();
      }
      result_.outcome = Outcome::Interrupted;
      // A failure still in its grace period (reap) must not turn the stop into
      // a restart: a scheduler that signals every process of a job at once
      // often finds one worker already exiting.
      pending_ = nullptr;
      auto now = Clock::now();
      if (stopping_ && !killed_) kill_all(now);  // asked twice: do not wait out the grace period
      begin_stop(now);
    }
  }

  void check_remote(Clock::time_point now) {
    if (!opts_.check_remote || stopping_ || now < next_remote_) return;
    next_remote_ = now + opts_.remote_poll_interval;
    std::optional<std::string> remote;
    try {
      remote = opts_.check_remote();
    } catch (const std::exception& ex) {
      remote = ex.what();
    }
    if (!remote) return;
    result_.outcome = Outcome::RemoteFailed;
    result_.remote_failure = *remote;
    begin_stop(now);
  }

  // Reads what is there now (bounded, so one chatty worker cannot starve the loop).
  void read_pipe(Worker& w, int stream) {
    const core::Fd& fd = w.pipe_fd[stream];
    for (int round = 0; round < 4 && fd.valid(); ++round) {
      ssize_t n = read(fd.get(), buf_, sizeof(buf_));
      if (n > 0) {
        w.sink[stream]->write(std::string_view(buf_, static_cast<size_t>(n)));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      close_pipe(w, stream);  // EOF or error
    }
  }

  void close_pipe(Worker& w, int stream) {
    if (!w.pipe_fd[stream].valid()) return;
    w.pipe_fd[stream].reset();
    w.sink[stream]->finish();
  }

  void loop() {
    std::vector<pollfd> fds;
    std::vector<std::pair<Worker*, int>> owners;
    std::optional<Clock::time_point> all_exited_at;
    Clock::time_point last_turn = Clock::now();
    for (;;) {
      auto now = Clock::now();
      const auto previous_turn = last_turn;
      last_turn = now;
      reap(now);
      check_remote(now);
      bool any_running = std::any_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.running; });
      bool any_pipe = std::any_of(workers_.begin(), workers_.end(),
                                  [](const Worker& w) { return w.pipe_fd[0].valid() || w.pipe_fd[1].valid(); });
      // A console whose reader fell behind: its pipes are left unread (the
      // workers wait on their output), but this loop goes on.
      bool congested = false;
      for (auto& w : workers_)
        for (int s = 0; s < 2; ++s) congested = congested || (w.pipe_fd[s].valid() && w.sink[s]->congested());
      if (congested && result_.signal != 0 && now >= signalled_at_ + kOutputAfterStop) {
        // Told to stop, and the console still does not take the output: what
        // is meant for it is thrown away from now on, but the pipes are still
        // read (the workers' shutdown must not block on them or die of
        // SIGPIPE, and log files still get everything).
        COHORT_WARN(kLaunch, "the console has not taken the workers' output for {} ms after the stop signal; "
                             "dropping what is meant for it",
                    kOutputAfterStop.count());
        for (auto& w : workers_)
          for (int s = 0; s < 2; ++s)
            if (w.sink[s]->congested()) w.sink[s]->drop_console();
        continue;
      }
      if (!any_running) {
        if (!all_exited_at) all_exited_at = now;
        // When stopping, children the workers left behind that ignore SIGTERM
        // get SIGKILL at kill_at_ like the workers would have, instead of
        // outliving the launcher (or running on through a restart).
        const bool leftovers = stopping_ && !killed_ && any_group_alive();
        if (!any_pipe && !leftovers) break;
        // Time the console was congested does not count: the output was
        // there, waiting for it, not left open by something still running.
        if (congested) *all_exited_at += now - previous_turn;
        if (any_pipe && now >= *all_exited_at + opts_.drain_timeout) {
          // Something the workers started still holds their output open: stop listening.
          COHORT_INFO(kLaunch, "worker output still open {} ms after the last exit; closing it",
                      opts_.drain_timeout.count());
          for (auto& w : workers_)
            for (int s = 0; s < 2; ++s) close_pipe(w, s);
          if (!leftovers) break;
        }
      }
      if (stopping_ && !killed_ && now >= kill_at_) kill_all(now);
      if (killed_ && any_running && now >= give_up_at_) {
        result_.unkillable = true;
        break;
      }

      auto wake = now + std::chrono::milliseconds(kMaxSleepMs);
      if (stopping_ && !killed_) wake = std::min(wake, kill_at_);
      if (killed_) wake = std::min(wake, give_up_at_);
      if (all_exited_at && any_pipe) wake = std::min(wake, *all_exited_at + opts_.drain_timeout);
      if (opts_.check_remote && !stopping_) wake = std::min(wake, next_remote_);
      if (pending_ != nullptr) wake = std::min(wake, pending_until_);
      if (congested) wake = std::min(wake, now + kCongestedPoll);  // to see the console catch up
      int timeout_ms = core::Deadline{wake}.remaining_ms(kMaxSleepMs);

      fds.clear();
      owners.clear();
      fds.push_back({opts_.signals->fd(), POLLIN, 0});
      for (auto& w : workers_)
        for (int s = 0; s < 2; ++s)
          if (w.pipe_fd[s].valid() && !w.sink[s]->congested()) {
            fds.push_back({w.pipe_fd[s].get(), POLLIN, 0});
            owners.emplace_back(&w, s);
          }
      int rc = poll(fds.data(), fds.size(), timeout_ms);
      if (rc < 0 && errno != EINTR)
        throw IoError(fmt::format("cohort run: poll failed: {}", std::strerror(errno)));
      if (rc <= 0) continue;
      if (fds[0].revents != 0) on_signals();
      for (size_t i = 1; i < fds.size(); ++i)
        if (fds[i].revents != 0) read_pipe(*owners[i - 1].first, owners[i - 1].second);
    }
    for (auto& w : workers_)
      for (int s = 0; s < 2; ++s) close_pipe(w, s);
  }

  const MonitorOptions& opts_;
  std::vector<Worker> workers_;
  AttemptResult result_;
  bool stopping_ = false;
  bool killed_ = false;
  Clock::time_point kill_at_{};
  Clock::time_point give_up_at_{};
  Clock::time_point next_remote_{};
  Clock::time_point signalled_at_{};  // the first stop signal
  char buf_[64 * 1024];
};

}  // namespace

AttemptResult run_attempt(std::vector<WorkerPlan>& plans, const MonitorOptions& opts) {
  Monitor m(plans, opts);
  return m.run();
}

}  // namespace cohort::launch
