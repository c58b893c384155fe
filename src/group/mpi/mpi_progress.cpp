// The MPI backend's progress thread (mpi_progress.hpp).
#include "group/mpi/mpi_progress.hpp"

#include <fmt/format.h>

#include <cstdlib>

namespace cohort::group::mpi {

void ThreadWork::wait(Millis timeout) {
  if (!done_.load(std::memory_order_acquire)) {
    std::unique_lock<std::mutex> lk(m_);
    auto done = [this] { return done_.load(std::memory_order_acquire); };
    if (timeout.count() > 0 && timeout < timeout_) {
      if (!cv_.wait_for(lk, timeout, done))
        throw TimeoutError(fmt::format(
            "rank {}: Work::wait timed out after {} ms on {}; the operation is still queued or running on the mpi "
            "backend's progress thread (MPI cannot cancel it: wait again, or let COHORT_TIMEOUT end the job)",
            rank_, timeout.count(), desc_.describe()));
    } else {
      cv_.wait(lk, done);
    }
  }
  if (err_) std::rethrow_exception(err_);
}

void ThreadWork::complete(std::exception_ptr err) {
  {
    std::lock_guard<std::mutex> g(m_);
    err_ = std::move(err);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

Progress& Progress::get() {
  static Progress* p = new Progress;  // never freed: see the header
  return *p;
}

void Progress::submit(std::function<void()> task) {
  static std::once_flag at_exit;
  // Registered after MPI's own finalisation (ensure_initialized ran before any
  // group existed), so it runs before it: queued calls finish before MPI_Finalize.
  std::call_once(at_exit, [] { std::atexit([] { Progress::get().stop(); }); });
  {
    std::lock_guard<std::mutex> g(m_);
    q_.push_back(std::move(task));
    outstanding_.fetch_add(1, std::memory_order_acq_rel);
    if (!running_) {
      running_ = true;
      thread_ = std::thread([this] { loop(); });
    }
  }
  work_cv_.notify_one();
}

void Progress::loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lk(m_);
      work_cv_.wait(lk, [this] { return stop_ || !q_.empty(); });
      if (q_.empty()) return;  // stop_, and every queued task ran
      task = std::move(q_.front());
      q_.pop_front();
    }
    task();
    task = nullptr;  // its captures go before anyone sees the queue idle
    bool idle;
    {
      std::lock_guard<std::mutex> g(m_);
      idle = outstanding_.fetch_sub(1, std::memory_order_acq_rel) == 1;
    }
    if (idle) idle_cv_.notify_all();
  }
}

void Progress::wait_idle() {
  if (!busy()) return;
  std::unique_lock<std::mutex> lk(m_);
  idle_cv_.wait(lk, [this] { return outstanding_.load(std::memory_order_acquire) == 0; });
}

void Progress::attach() {
  std::lock_guard<std::mutex> g(m_);
  ++groups_;
}

void Progress::detach() {
  bool last;
  {
    std::lock_guard<std::mutex> g(m_);
    last = --groups_ == 0;
  }
  if (last) stop();
}

void Progress::stop() {
  std::thread t;
  {
    std::lock_guard<std::mutex> g(m_);
    if (!running_ || stop_ || thread_.get_id() == std::this_thread::get_id()) return;
    stop_ = true;
    t = std::move(thread_);
  }
  work_cv_.notify_all();
  t.join();  // it ran every queued task first
  std::lock_guard<std::mutex> g(m_);
  stop_ = false;
  running_ = false;
  if (!q_.empty()) {  // queued after the thread left: run them on a new one
    running_ = true;
    thread_ = std::thread([this] { loop(); });
  }
}

}  // namespace cohort::group::mpi
