// One attempt of a node's workers: spawn them, forward their output, watch
// them exit, and stop them all when one fails, when another node reports a
// failure, or when the launcher is told to stop.
//
// Stopping a worker means SIGTERM to its process group, then SIGKILL to the
// group once the grace period (COHORT_TERM_TIMEOUT) has passed. Runs on the
// launcher's main thread; blocks in poll() on the output pipes and the
// SignalChannel, waking at least once a second. Output is queued for the
// console writer thread (output.hpp), never written here, and a pipe whose
// console is congested is left unread until it catches up.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "launch/output.hpp"
#include "launch/process.hpp"

namespace cohort::launch {

struct WorkerPlan {
  int local_rank = 0;
  int global_rank = 0;
  SpawnRequest spawn;          // stdout_fd / stderr_fd are filled in by run_attempt
  StreamRoute route;
  std::string log_dir;         // this worker's log directory, when route writes files
};

struct WorkerExit {
  int local_rank = -1;
  int global_rank = -1;
  long pid = 0;
  int exit_code = 0;           // meaningful when signal == 0
  int signal = 0;              // the signal that killed it, or 0
  std::string stderr_log;      // its stderr log file when stderr did not reach the console
};
// "exited with code 3" / "was killed by signal 9 (SIGKILL)"
std::string describe_exit(const WorkerExit& e);

struct AttemptResult {
  enum class Outcome { Succeeded, WorkerFailed, RemoteFailed, Interrupted };
  Outcome outcome = Outcome::Succeeded;
  std::optional<WorkerExit> failure;  // the first local worker that failed
  std::string remote_failure;         // what check_remote reported
  int signal = 0;                     // the stop signal the launcher received
  int stopped = 0;                    // workers still running that had to be stopped
  bool unkillable = false;            // some worker survived SIGKILL for kill_wait
};

struct MonitorOptions {
  SignalChannel* signals = nullptr;                    // required
  std::chrono::milliseconds term_timeout{10000};       // SIGTERM -> SIGKILL grace period
  std::chrono::milliseconds kill_wait{10000};          // after SIGKILL, give up waiting after this
  std::chrono::milliseconds drain_timeout{2000};       // output still open after every worker exited
  std::chrono::milliseconds remote_poll_interval{500};
  // Called every remote_poll_interval while no stop is under way; returns a
  // description of another node's failure, or nullopt. An exception counts as a
  // failure described by its message (the store is gone).
  std::function<std::optional<std::string>()> check_remote;
  // Called once, at the first local failure, before the others are stopped.
  std::function<void(const WorkerExit&)> on_local_failure;
};

// Runs the workers to completion. Throws IoError when a worker cannot be
// started or a log file cannot be created (the workers already started are
// stopped first).
AttemptResult run_attempt(std::vector<WorkerPlan>& plans, const MonitorOptions& opts);

}  // namespace cohort::launch
