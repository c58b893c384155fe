// WorkImpl: the Work handle of the native backend. Completed exactly once, by
// the thread that executed the operation; waited on by any thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <string>

#include "cohort/process_group.hpp"
#include "group/op.hpp"

namespace cohort::group {

class WorkImpl;

// The group's side of Work::wait: a waiter whose operation is next in line
// and not yet picked up by the progress thread runs it itself, which saves
// two thread wake-ups (tens of microseconds on a VM) for call-then-wait code.
class WorkRunner {
 public:
  virtual ~WorkRunner() = default;
  // Runs `w` on the calling thread if it is at the head of the queue and the
  // group is idle; returns false (doing nothing) otherwise.
  virtual bool run_if_next(WorkImpl* w) = 0;
};

class WorkImpl final : public Work {
 public:
  WorkImpl(const OpDesc& desc, Millis default_timeout, std::weak_ptr<WorkRunner> runner = {})
      : desc_(desc), default_timeout_(default_timeout), runner_(std::move(runner)) {}

  bool is_completed() const override { return done_.load(std::memory_order_acquire); }
  void wait(Millis timeout) override;
  std::exception_ptr error() const override;
  std::string describe() const override { return desc_.describe(); }

  void complete(std::exception_ptr err);

 private:
  OpDesc desc_;  // formatted only when asked (the inline path must stay cheap)
  Millis default_timeout_;
  std::weak_ptr<WorkRunner> runner_;
  std::atomic<bool> done_{false};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::exception_ptr err_;
};

}  // namespace cohort::group
