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
#pragma once

#include <span>

#include "core/clock.hpp"
#include "transport/transport.hpp"

namespace cohort::transport {

class Engine {
 public:
  // shm_waiter: the shared-memory doorbell of this rank's group, or nullptr.
  explicit Engine(Waiter* shm_waiter);

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
