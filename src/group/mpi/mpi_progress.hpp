// The MPI backend's progress thread: large operations run as MPI's BLOCKING
// calls on it, in the order they were issued, while the caller goes on.
//
// Why a thread and not MPI's nonblocking calls: Open MPI runs nonblocking
// collectives (MPI_Iallreduce, ...) through libnbc, whose schedules are
// 25-30% slower than the blocking algorithms for 1-16 MiB; the blocking call
// on another thread gets MPI's full speed and still lets the caller overlap
// computation with the transfer (DDP's bucket allreduces during backward).
//
// Why one thread for the process, not one per group: MPI_THREAD_SERIALIZED
// allows one thread in MPI at a time, and a blocking collective holds it until
// every member joins. Two groups' threads could then take the library in
// different orders on different ranks and wait for each other forever; one
// FIFO keeps every MPI call in the order the program issued it, the same on
// every rank. The thread starts with the first queued operation and is joined
// when the last group shuts down (or at exit, before MPI_Finalize).
//
// Ordering with the caller's own MPI calls (mpi_group.cpp): while anything is
// queued or running, a collective of any size is queued behind it; a
// point-to-point call, new_group, shutdown and Work::wait of a point-to-point
// Work first wait until the queue is empty (wait_idle). No busy waiting: a
// mutex and condition variables.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include "cohort/process_group.hpp"
#include "group/op.hpp"

namespace cohort::group::mpi {

// The Work of an operation run by the progress thread.
class ThreadWork final : public Work {
 public:
  ThreadWork(const OpDesc& d, int rank, Millis timeout) : desc_(d), rank_(rank), timeout_(timeout) {}

  bool is_completed() const override { return done_.load(std::memory_order_acquire); }
  // Blocks on a condition variable until the progress thread completed the
  // operation. A timeout shorter than the operation's own throws TimeoutError
  // when it passes (the operation keeps running); otherwise the watchdog
  // enforces the operation's deadline.
  void wait(Millis timeout) override;
  std::exception_ptr error() const override { return is_completed() ? err_ : nullptr; }
  std::string describe() const override { return desc_.describe(); }

  const OpDesc& desc() const { return desc_; }
  Millis timeout() const { return timeout_; }
  // Called once by the progress thread; err: the operation's exception or nullptr.
  void complete(std::exception_ptr err);

 private:
  const OpDesc desc_;
  const int rank_;
  const Millis timeout_;
  std::mutex m_;
  std::condition_variable cv_;
  std::atomic<bool> done_{false};
  std::exception_ptr err_;  // written before done_ is set
};

class Progress {
 public:
  // The process's progress thread (made on first use, never freed: it may be
  // needed until exit).
  static Progress& get();

  // Queues a task (which must not throw); the thread runs tasks one at a time
  // in FIFO order, starting the thread if it is not running.
  void submit(std::function<void()> task);
  // True while a task is queued or running. One atomic load (the small-message path asks it every call).
  bool busy() const { return outstanding_.load(std::memory_order_acquire) != 0; }
  // Returns when nothing is queued or running. Not from the progress thread.
  void wait_idle();
  // A group attaches when it is made and detaches when it shuts down; the
  // last detach stops and joins the thread (after it ran every queued task).
  void attach();
  void detach();
  // Runs the queued tasks, then joins the thread. Safe to call when it is not running.
  void stop();

 private:
  Progress() = default;
  void loop();

  std::mutex m_;
  std::condition_variable work_cv_, idle_cv_;
  std::deque<std::function<void()>> q_;
  std::atomic<int> outstanding_{0};  // queued + running
  int groups_ = 0;
  bool running_ = false;  // a thread was started and not yet joined
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace cohort::group::mpi
