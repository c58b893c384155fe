#include "group/work.hpp"

#include <sched.h>

#include <algorithm>
#include <chrono>

#include <fmt/format.h>

#include "core/env.hpp"

namespace cohort::group {

void WorkImpl::complete(std::exception_ptr err) {
  {
    std::lock_guard<std::mutex> g(mu_);
    err_ = err;
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

namespace {
const core::Knob kWaitSpinUs{"COHORT_WAIT_SPIN_US", "20",
                             "microseconds Work::wait polls for completion before it blocks on a condition variable",
                             core::KnobKind::Int};
}

void WorkImpl::wait(Millis timeout) {
  // Running the operation here would bind this wait to the operation's own
  // deadline: with a timeout of its own the caller waits instead.
  if (!done_.load(std::memory_order_acquire) && timeout.count() <= 0) {
    if (auto r = runner_.lock()) r->run_if_next(this);
  }
  if (!done_.load(std::memory_order_acquire)) {
    static const int spin_us = static_cast<int>(kWaitSpinUs.integer());
    auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
    while (!done_.load(std::memory_order_acquire) && std::chrono::steady_clock::now() < until) sched_yield();
  }
  if (!done_.load(std::memory_order_acquire)) {
    Millis t = std::min(timeout.count() > 0 ? timeout : default_timeout_, core::kLongestWait);
    std::unique_lock<std::mutex> lk(mu_);
    // The operation has its own deadline (its transport waits); this bound
    // only protects a caller whose operation is stuck behind others.
    // The slack lets a timed-out operation finish its hang verdict (hang_verdict.hpp) and report it.
    // Without a timeout of the caller's, the operation's own deadline ends it
    // first; the slack lets it finish its hang verdict (hang_verdict.hpp) and
    // report that. A caller's timeout is kept as given.
    const Millis bound = timeout.count() > 0 ? t : t + std::chrono::seconds(5);
    if (!cv_.wait_for(lk, bound, [&] { return done_.load(std::memory_order_acquire); }))
      throw TimeoutError(fmt::format("Work::wait timed out after {} ms on {}; the operation is still running",
                                     bound.count(), desc_.describe()));
  }
  std::lock_guard<std::mutex> g(mu_);
  if (err_) std::rethrow_exception(err_);
}

std::exception_ptr WorkImpl::error() const {
  std::lock_guard<std::mutex> g(mu_);
  return err_;
}

}  // namespace cohort::group
