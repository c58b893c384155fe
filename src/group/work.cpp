#include "group/work.hpp"

#include <fmt/format.h>

namespace cohort::group {

void WorkImpl::complete(std::exception_ptr err) {
  {
    std::lock_guard<std::mutex> g(mu_);
    err_ = err;
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

void WorkImpl::wait(Millis timeout) {
  if (!done_.load(std::memory_order_acquire)) {
    Millis t = timeout.count() > 0 ? timeout : default_timeout_;
    std::unique_lock<std::mutex> lk(mu_);
    // The operation has its own deadline (its transport waits); this bound
    // only protects a caller whose operation is stuck behind others.
    if (!cv_.wait_for(lk, t, [&] { return done_.load(std::memory_order_acquire); }))
      throw TimeoutError(fmt::format("Work::wait timed out after {} ms on {}; the operation is still running",
                                     t.count(), desc_.describe()));
  }
  std::lock_guard<std::mutex> g(mu_);
  if (err_) std::rethrow_exception(err_);
}

std::exception_ptr WorkImpl::error() const {
  std::lock_guard<std::mutex> g(mu_);
  return err_;
}

}  // namespace cohort::group
