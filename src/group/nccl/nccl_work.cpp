// NcclWork: completion of one NCCL operation, seen through its CUDA event.
#include <fmt/format.h>

#include "core/exception_text.hpp"
#include "group/nccl/nccl_comm.hpp"

namespace cohort::group::nccl {

NcclWork::~NcclWork() {
  if (done_event_ != nullptr) (void)cudaEventDestroy(done_event_);  // CUDA frees it once it has completed
}

bool NcclWork::poll_locked() const {
  if (done_) return true;
  const cudaError_t q = cudaEventQuery(done_event_);
  // After an abort NCCL's kernels stop early and the event completes anyway:
  // a broken group's unfinished-looking work failed, whatever the event says.
  if (std::exception_ptr b = comm_->broken()) {
    (void)cudaGetLastError();
    err_ = std::make_exception_ptr(Error(fmt::format("rank {}: {} did not complete: this group failed: {}",
                                                     comm_->setup().rank, desc_.describe(),
                                                     core::exception_text(b))));
    done_ = true;
    return true;
  }
  if (q == cudaSuccess) {
    done_ = true;
    return true;
  }
  if (q != cudaErrorNotReady) {
    (void)cudaGetLastError();
    try {
      comm_->fail(desc_, 'e', "the CUDA stream failed: " + cuda_error_text(q));
    } catch (...) {
      err_ = std::current_exception();
    }
    done_ = true;
    return true;
  }
  return false;
}

bool NcclWork::is_completed() const {
  std::lock_guard<std::mutex> g(mu_);
  return poll_locked();
}

std::exception_ptr NcclWork::error() const {
  std::lock_guard<std::mutex> g(mu_);
  poll_locked();
  return err_;
}

bool NcclWork::watch_once() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (poll_locked()) return true;
  }
  try {
    comm_->check_health(desc_);
    if (deadline_.passed())
      comm_->fail(desc_, 't', "it did not complete before its deadline (COHORT_TIMEOUT or the call's timeout)");
  } catch (...) {
    std::lock_guard<std::mutex> g(mu_);
    if (!done_) {
      err_ = std::current_exception();
      done_ = true;
    }
    return true;
  }
  return false;
}

void NcclWork::wait(Millis timeout) {
  const Millis t = timeout.count() > 0 ? timeout : comm_->setup().timeout;
  const auto wait_deadline = core::Deadline::after(t);
  poll_until(core::Deadline::never(), [&] { return watch_once() || wait_deadline.passed(); });
  std::lock_guard<std::mutex> g(mu_);
  if (!done_)
    throw TimeoutError(
        fmt::format("Work::wait timed out after {} ms on {}; the operation is still running (its own "
                    "deadline is in {} ms)",
                    t.count(), desc_.describe(), deadline_.remaining_ms()));
  if (err_) std::rethrow_exception(err_);
}

void NcclWork::wait_on_stream(void* cuda_stream, Millis /*timeout: the watchdog applies the operation's own*/) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (poll_locked()) {
      if (err_) std::rethrow_exception(err_);
      return;
    }
  }
  comm_->check_health(desc_);  // what NCCL already reports fails now, not at the next call
  // The stream's device, not whatever device this thread has current: a null
  // stream means that device's legacy default stream.
  DeviceGuard guard(comm_->device());
  const cudaError_t ce = cudaStreamWaitEvent(static_cast<cudaStream_t>(cuda_stream), done_event_, 0);
  if (ce != cudaSuccess) {
    (void)cudaGetLastError();
    comm_->fail(desc_, 'e', "making the caller's stream wait for it failed: " + cuda_error_text(ce));
  }
}

}  // namespace cohort::group::nccl
