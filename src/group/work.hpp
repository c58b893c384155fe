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

class WorkImpl final : public Work {
 public:
  WorkImpl(const OpDesc& desc, Millis default_timeout) : desc_(desc), default_timeout_(default_timeout) {}

  bool is_completed() const override { return done_.load(std::memory_order_acquire); }
  void wait(Millis timeout) override;
  std::exception_ptr error() const override;
  std::string describe() const override { return desc_.describe(); }

  void complete(std::exception_ptr err);

 private:
  OpDesc desc_;  // formatted only when asked (the inline path must stay cheap)
  Millis default_timeout_;
  std::atomic<bool> done_{false};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::exception_ptr err_;
};

}  // namespace cohort::group
