// Engine: drives a set of sends and receives, on any mix of connections, to completion.
//
// Collectives call run() once per algorithm step (e.g. "send chunk 3 to the
// right, receive chunk 2 from the left and reduce it"). All operations
// progress together, so two ranks that send to each other never deadlock on
// full buffers.
//
// Waiting policy (docs/design.md habit 9: 8 ranks on 2 cores must make progress):
// spin for COHORT_SPIN_US, then sched_yield() until COHORT_YIELD_US has passed,
// then sleep on the shared-memory doorbell (a futex) and/or poll() the TCP
// sockets, waking at least every 100 ms to check peer liveness and the deadline.
// Where the host's ranks outnumber its CPUs the spin is skipped (spin_us_for).
#pragma once

#include <span>

#include "core/clock.hpp"
#include "transport/transport.hpp"

namespace cohort::transport {

// Microseconds a waiting rank busy-polls before it yields: COHORT_SPIN_US when
// set; else 30, or 0 when the ranks on this host outnumber its CPUs
// (host_ranks > host_cpus; either <= 0: unknown, so 30). There a spinning rank
// holds a core that the rank it waits for needs to run: with 4 and 8 ranks on
// 2 cores the spin made allreduces below 100 KiB 3-8x slower
// (docs/performance.md, "More ranks than cores"). Open MPI yields when
// oversubscribed for the same reason (mpi_yield_when_idle).
int spin_us_for(int host_ranks, int host_cpus);

// host_ranks > host_cpus, both known (> 0): the machine is oversubscribed.
bool cpus_oversubscribed(int host_ranks, int host_cpus);

class Engine {
 public:
  // shm_waiter: the shared-memory doorbell of this rank's group, or nullptr.
  // spin_us: the busy-poll before yielding (spin_us_for).
  Engine(Waiter* shm_waiter, int spin_us);

  // Runs every op to completion. Throws PeerError (from the connections) or
  // TimeoutError naming the peer whose message was still outstanding.
  void run(std::span<SendOp> sends, std::span<RecvOp> recvs, core::Deadline deadline);

  void set_waiter(Waiter* w) { shm_waiter_ = w; }

 private:
  bool progress_all(std::span<SendOp> sends, std::span<RecvOp> recvs, bool& all_done);
  void sleep_once(std::span<SendOp> sends, std::span<RecvOp> recvs, int timeout_ms);
  [[noreturn]] void throw_timeout(std::span<SendOp> sends, std::span<RecvOp> recvs, double waited_s);

  Waiter* shm_waiter_;
  int spin_us_;
  int yield_us_;
};

}  // namespace cohort::transport
