// cohort/stop_signal.hpp: stop on a signal at a step every rank agrees on,
// so that the steps trained since the last checkpoint are not lost.
//
//   cohort::StopSignal stop;                 // SIGTERM from here on sets a flag
//   for (;;) {
//     ... one training step ...
//     if (int sig = stop.agreed(*pg)) {      // collective: every rank, every step
//       save_checkpoint(...);                // the state after this very step
//       return 128 + sig;                    // as if the signal had ended the process
//     }
//   }
//
// Schedulers stop a job by sending SIGTERM and, a grace period later,
// SIGKILL: Slurm (KillWait, 30 s by default), Kubernetes
// (terminationGracePeriodSeconds), a cloud's spot reclaim, and `cohort run`
// itself when it is stopped (COHORT_TERM_TIMEOUT, 10 s). The signal reaches
// each rank at another moment; agreed() is a MAX allreduce of one int over
// group.host_group() (a microsecond or two on shared memory, one round trip
// over TCP), so every rank sees the same answer after the same step. When a
// rank of the group is already dead, the allreduce fails like any
// collective would, and no rank saves a state the others cannot match.
//
// A signal sent again is not a second request: a scheduler may signal
// every process of the job and the launcher pass its own on. The one
// signal that ends the process at once, as if there were no StopSignal, is
// the SIGTERM `cohort run` sends when it stops the workers because one of
// them failed: it queues that one with the value kStopAfterFailure
// (sigqueue), since the survivors could not agree on a step anyway, and a
// survivor blocked in a collective with the dead rank would otherwise wait
// for the SIGKILL. (A stop for another node's failure comes as a plain
// SIGTERM: a survivor blocked in a collective that no error ends, as over
// NCCL, then waits for the SIGKILL, COHORT_TERM_TIMEOUT later.)
//
// One StopSignal at a time in a process; its destructor puts the previous
// handlers back. Ask for SIGUSR1 too (StopSignal({SIGTERM, SIGUSR1})) for
// Slurm's `--signal=USR1@120`, which warns a job before its time limit.
#pragma once

#include <csignal>
#include <vector>

#include "cohort/export.hpp"
#include "cohort/process_group.hpp"

namespace cohort {

// The value (si_value.sival_int) of the SIGTERM `cohort run` queues to a
// worker it stops because another worker of the node failed.
inline constexpr int kStopAfterFailure = 0x636f6831;

class COHORT_API StopSignal {
 public:
  // Installs a handler for each of `signals` (SIGTERM, SIGINT, SIGHUP, SIGUSR1,
  // SIGUSR2, SIGQUIT). InvalidArgument for any other signal (SIGKILL and
  // SIGSTOP cannot be caught; the rest mean a fault, not a request), for a
  // signal named twice, and when another StopSignal is alive.
  explicit StopSignal(std::vector<int> signals = {SIGTERM});
  ~StopSignal();
  StopSignal(const StopSignal&) = delete;
  StopSignal& operator=(const StopSignal&) = delete;

  // The first of the signals this process received, or 0 (no communication).
  int received() const;
  // Collective over `group`: the signal any rank received (the highest
  // number when several), or 0 on every rank when none did.
  int agreed(ProcessGroup& group);

 private:
  std::vector<int> signals_;
  std::vector<struct sigaction> previous_;
};

}  // namespace cohort
