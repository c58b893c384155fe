// One MPI communicator of the backend and the Work handles of its calls.
//
// Two paths (docs/mpi.md):
//   - blocking: an operation of at most COHORT_MPI_BLOCKING_BYTES runs as
//     MPI's blocking call on the caller's thread, under the watchdog, and
//     returns the communicator's completed Work: one object per communicator
//     that lives as long as the process, handed out through a shared_ptr
//     without a control block, so that returning and dropping it costs no
//     allocation and no atomic reference count (what an 8-byte allreduce's
//     latency needs). Its describe() names the latest blocking call.
//   - nonblocking: a larger one starts MPI's nonblocking call (MPI_Iallreduce,
//     ...) and returns an MpiWork; Work::wait (MPI_Waitall) or is_completed
//     (MPI_Testall) drive it to completion. Open MPI progresses nonblocking
//     collectives inside those calls, so the work happens in wait.
// Collectives of one communicator complete in the order they were issued:
// waiting on one first completes the collectives issued before it, and a
// blocking collective first completes every pending one. Point-to-point
// Works (send, recv, batch) complete on their own, as MPI's requests do, so
// that "post a receive, then send what lets the peer answer it" works.
//
// Threads: every member below is touched only under mpi_lock() (one thread in
// MPI at a time: MPI_THREAD_SERIALIZED), but seq and shut_down (atomics). With
// COHORT_MPI_ASYNC=thread (the default) large collectives do not make
// MpiWorks: they run blocking on the progress thread (mpi_progress.hpp) and
// return a ThreadWork; only point-to-point calls use the nonblocking path.
#pragma once

#include <mpi.h>

#include <array>
#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "cohort/process_group.hpp"
#include "core/clock.hpp"
#include "group/mpi/mpi_runtime.hpp"
#include "group/op.hpp"

namespace cohort::group::mpi {

class CommState;

// The completed Work of the blocking path (one per communicator, never freed).
class DoneWork final : public Work {
 public:
  bool is_completed() const override { return true; }
  void wait(Millis) override {}
  std::exception_ptr error() const override { return nullptr; }
  std::string describe() const override { return last_.describe(); }
  // Copies the few fields describe() needs (no batch: the blocking path has none).
  void set(const OpDesc& d) {
    last_.coll = d.coll;
    last_.send = d.send;
    last_.recv = d.recv;
    last_.op = d.op;
    last_.root = d.root;
    last_.peer = d.peer;
    last_.tag = d.tag;
    last_.seq = d.seq;
  }

 private:
  OpDesc last_{collectives::Coll::Barrier};
};

// The Work of a nonblocking MPI call.
class MpiWork final : public Work {
 public:
  MpiWork(std::shared_ptr<CommState> comm, const OpDesc& d, Millis timeout);

  bool is_completed() const override;
  void wait(Millis timeout) override;
  std::exception_ptr error() const override;
  std::string describe() const override { return desc_.describe(); }
  bool p2p() const { return p2p_; }

  // Filled by the issuing call before the Work is handed out.
  std::vector<MPI_Request> reqs;
  std::vector<int64_t> recv_counts;  // per request: the bytes a receive must get, -1: no check
  std::function<void()> finish;      // after success: Avg's division, ... (never throws)
  std::vector<uint8_t> scratch;      // kept alive until completion (in-place alltoall's copy)

 private:
  friend class CommState;
  // Under mpi_lock. Blocks (with the watchdog) until the requests complete,
  // or, with poll_until set, tests them until then and returns false if they
  // have not completed. Marks the Work done (with its error, if any).
  bool drive(const core::Deadline* poll_until);
  bool test_once();  // MPI_Testall once; completes the Work when it returns true
  void complete(int rc, const char* call, std::vector<MPI_Status>& st);

  std::shared_ptr<CommState> comm_;
  OpDesc desc_;
  core::Deadline deadline_;  // the operation's own (issue time + timeout)
  Millis timeout_;
  bool p2p_;
  std::atomic<bool> done_{false};
  std::exception_ptr err_;  // written before done_ is set
};

class CommState : public std::enable_shared_from_this<CommState> {
 public:
  CommState(MPI_Comm comm, Millis timeout, std::vector<int> world_ranks);
  ~CommState();

  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1;
  Millis timeout;
  std::vector<int> world_ranks;
  std::atomic<uint64_t> seq{0};        // numbers the operations (also issued without mpi_lock: queued ones)
  std::atomic<bool> shut_down{false};  // read without mpi_lock by queued operations
  std::deque<std::shared_ptr<MpiWork>> pending;

  // The communicator's completed Work, now describing d.
  WorkPtr done(const OpDesc& d) {
    done_->set(d);
    return WorkPtr(std::shared_ptr<void>(), done_);  // aliasing, no owner: no reference count
  }
  // Completes every pending Work, or only the collectives (blocking,
  // watchdog armed). Under mpi_lock.
  void drain(bool collectives_only = false);
  // Completes w: a collective after the collectives issued before it, a
  // point-to-point Work alone. With poll_until, gives up at that time and
  // returns false. Under mpi_lock.
  bool complete_through(const MpiWork* w, const core::Deadline* poll_until);
  // Completes the pending Works whose requests have finished (collectives in order). Under mpi_lock.
  void test_pending();
  // Drains, then frees the communicator. Never throws.
  void shutdown();

 private:
  DoneWork* done_;  // immortal: Works handed out may outlive this communicator
};

}  // namespace cohort::group::mpi
