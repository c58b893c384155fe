// Processes and signals for the launcher: the signalfd that turns SIGCHLD and
// the stop signals into poll()-able events, spawning one worker, and signalling
// a worker's process group.
//
// Threading contract: the launcher's main thread forks the workers and owns the
// SignalChannel. The channel must exist before any other thread starts (the
// store server's loop), so that every thread inherits the blocked mask and the
// signals reach the signalfd instead of killing the process.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <string>
#include <vector>

#include "core/fd.hpp"

namespace cohort::launch {

// Blocks SIGCHLD, SIGINT, SIGTERM, SIGHUP and SIGQUIT in the calling thread and
// reads them from a signalfd; ignores SIGPIPE (a closed console must not kill
// the launcher). The destructor restores the mask and SIGPIPE's disposition.
// One instance at a time, created on the main thread.
class SignalChannel {
 public:
  SignalChannel();
  ~SignalChannel();
  SignalChannel(const SignalChannel&) = delete;
  SignalChannel& operator=(const SignalChannel&) = delete;

  int fd() const { return fd_.get(); }
  // Reads every pending signal without blocking; SIGCHLD comes back as SIGCHLD.
  std::vector<int> drain();
  // Waits up to timeout_ms for a stop signal (SIGINT/TERM/HUP/QUIT) and returns
  // it, or 0. SIGCHLDs read meanwhile are dropped: callers reap with waitpid.
  int wait_stop_signal(int timeout_ms);
  // The mask the launcher had before; workers get it back before exec.
  const sigset_t& original_mask() const { return original_mask_; }

 private:
  core::Fd fd_;
  sigset_t original_mask_;
  struct sigaction original_pipe_;
};

bool is_stop_signal(int sig);
// "SIGKILL", "SIGSEGV", ...; "signal 42" for unnamed ones.
std::string signal_name(int sig);

struct SpawnRequest {
  std::string path;                // executable (already resolved, see resolve_program)
  std::vector<std::string> argv;   // argv[0] included
  std::vector<std::string> env;    // "K=V"
  int stdout_fd = -1;              // the worker's stdout / stderr (write ends)
  int stderr_fd = -1;
  const sigset_t* signal_mask = nullptr;  // restored in the worker before exec
  std::vector<int> cpus;           // sched_setaffinity in the worker before exec (--bind); empty: inherit
};

// Forks and execs one worker: stdin from /dev/null, in its own process group
// (pgid == pid, so its children are signalled with it), with
// PR_SET_PDEATHSIG(SIGKILL) so that it dies if the launcher's main thread dies.
// Pins it to req.cpus when given. Blocks only until the exec succeeded or
// failed. Throws IoError naming the program and errno when fork, pinning or
// exec fails (the child is reaped then).
pid_t spawn_worker(const SpawnRequest& req);

// Sends sig to the process group `pgid`; a group that is already gone is fine.
void signal_group(pid_t pgid, int sig);

}  // namespace cohort::launch
