// NcclComm: one NCCL communicator with its CUDA stream, and the failure
// handling of the NCCL backend. NcclWork: the Work handle of one operation.
//
// Every communicator is non-blocking (ncclConfig_t.blocking = 0): no NCCL call
// blocks the host, so that a rank whose peer hangs or dies can give up at its
// deadline and ncclCommAbort instead of hanging inside NCCL. A call that
// returns ncclInProgress is polled with ncclCommGetAsyncError until it leaves
// that state, and no other NCCL call is made on the communicator meanwhile
// (NCCL's rule for non-blocking communicators).
//
// Operations are enqueued on the communicator's own stream from the caller's
// thread; a CUDA event recorded after each one is its completion. The stream
// first waits (on the GPU, not the host) for the caller's stream (the legacy
// default stream, or the one a CudaStreamScope names on the calling thread),
// so that kernels the caller launched there before the call have produced its
// input. Work::wait polls the event, the communicator's asynchronous error, and
// (once a second) the group's "failure" key in the store, all against the
// operation's deadline; on an error or at the deadline it records the first
// failure in the store, aborts the communicator and throws a typed error naming
// the operation. The group is then broken: later calls fail at once.
//
// Work::wait_on_stream (DDP on the GPU) does not block the host: the caller's
// stream waits on the event. So that a hung operation cannot then hang the
// caller's next synchronisation forever, a watchdog thread (started with the
// first operation) looks at every operation in flight ten times a second,
// applies the same checks and deadline as Work::wait, and fails the group
// (aborting the communicator stops its kernels, so the waiting streams go on).
// The failure is thrown by the group's next call, as in PyTorch's NCCL
// process group.
//
// Threads: issue from one thread at a time; wait, is_completed and error may
// be called from any thread. mu_ serialises every NCCL call on the communicator.
#pragma once

#include <atomic>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "group/native_group.hpp"
#include "group/nccl/nccl_util.hpp"
#include "group/op.hpp"

namespace cohort::group::nccl {

class NcclWork;

class NcclComm : public std::enable_shared_from_this<NcclComm> {
 public:
  // Creates the world communicator: rank 0 calls ncclGetUniqueId and sets it
  // under "nccl_id" in setup.store, every rank calls ncclCommInitRankConfig on
  // `device` and waits for it with the setup's timeout.
  static std::shared_ptr<NcclComm> init(const GroupSetup& setup, int device);
  // ncclCommSplit of this communicator (collective over all of its ranks):
  // members get the new communicator, the others nullptr.
  std::shared_ptr<NcclComm> split(const GroupSetup& child, bool member, int key);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  const GroupSetup& setup() const { return setup_; }
  int device() const { return device_; }

  // Enqueues one operation whose arguments the caller has validated (group/op.hpp
  // validate, device buffers): `enqueue` makes the NCCL (and CUDA) calls on the
  // given communicator and stream, with the device set and mu_ held. Returns
  // the operation's Work. Throws the group's earlier failure, or fails the
  // group when NCCL reports an error.
  WorkPtr issue(OpDesc d, const std::function<ncclResult_t(ncclComm_t, cudaStream_t)>& enqueue);

  // One round of health checks for an operation being waited on: the
  // communicator's asynchronous error and, at most once a second, the store's
  // "failure" key. Fails the group (throws) when either reports a failure.
  void check_health(const OpDesc& d);
  // Records the first failure in the store, aborts the communicator, breaks
  // the group and throws the typed error. kind: 't' timeout, 'p' peer, 'e' other.
  [[noreturn]] void fail(const OpDesc& d, char kind, const std::string& reason);
  // The same for something that is not one operation ("new_group (sub-group 0.1)").
  [[noreturn]] void fail(const std::string& what, char kind, const std::string& reason);
  // The failure that broke the group, or nullptr.
  std::exception_ptr broken() const;

  // Lets the stream drain (up to the group's timeout), then ncclCommFinalize
  // and ncclCommDestroy; ncclCommAbort when the group is broken or draining
  // fails. Idempotent; never throws.
  void shutdown() noexcept;
  bool is_shut_down() const;

 private:
  NcclComm(GroupSetup setup, int device) : setup_(std::move(setup)), device_(device) {}
  // Polls ncclCommGetAsyncError(c) (mu_ held for each query) until c leaves
  // ncclInProgress; returns its final state, or ncclInProgress if the deadline
  // passed first. `own`: c is comm_, which another thread may abort meanwhile
  // (then the result is ncclInvalidUsage). Each round also looks at the store's
  // "failure" key (once a second): `peer_failure` gets another rank's failure.
  ncclResult_t wait_ready(ncclComm_t c, bool own, core::Deadline deadline, std::string* peer_failure);
  // The store's "failure" key if another rank set it, checked at most once a second.
  std::string poll_store_failure();
  void make_stream();
  std::string context(const std::string& what) const;
  std::string record_first_failure(const std::string& why);
  void abort_locked() noexcept;
  // Hands a new operation to the watchdog, starting it on the first call.
  void watch(const std::shared_ptr<NcclWork>& w);
  void stop_watchdog() noexcept;

  // The watchdog's state, shared with its thread so that the thread never
  // touches the communicator itself (a work it holds may be its last owner).
  // It owns the operations in flight, so that one whose Work the caller
  // dropped (DDP drops a bucket's after wait_on_stream) is still watched; it
  // lets go of each when it finishes or fails, and of all at shutdown.
  struct Watch {
    std::mutex mu;
    std::condition_variable cv;
    bool stop = false;
    std::vector<std::shared_ptr<NcclWork>> works;
  };
  std::shared_ptr<Watch> watch_ = std::make_shared<Watch>();
  std::thread watchdog_;

  GroupSetup setup_;
  int device_;
  mutable std::mutex mu_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t caller_ready_ = nullptr;  // recorded on the legacy default stream before each operation
  std::exception_ptr broken_;
  bool shut_ = false;
  bool aborted_ = false;
  uint64_t next_seq_ = 0;
  std::atomic<int64_t> next_store_check_{0};  // Clock ticks; see poll_store_failure
};

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclComm> comm, OpDesc d, cudaEvent_t done, core::Deadline deadline)
      : comm_(std::move(comm)), desc_(std::move(d)), done_event_(done), deadline_(deadline) {}
  ~NcclWork() override;

  bool is_completed() const override;
  void wait(Millis timeout) override;
  std::exception_ptr error() const override;
  std::string describe() const override { return desc_.describe(); }
  // The stream waits on the operation's event (the host does not). Throws the
  // operation's error if it already failed, or the group's.
  void wait_on_stream(void* cuda_stream, Millis timeout) override;
  // One round of the watchdog: true once the operation is finished (failed
  // included); fails the group when its deadline passed or the group is unhealthy.
  bool watch_once();

 private:
  // Queries the event once (mu_ held): true when the work is finished, with
  // err_ set if it failed.
  bool poll_locked() const;

  std::shared_ptr<NcclComm> comm_;
  OpDesc desc_;
  cudaEvent_t done_event_;
  core::Deadline deadline_;
  mutable std::mutex mu_;
  mutable bool done_ = false;
  mutable std::exception_ptr err_;
};

}  // namespace cohort::group::nccl
