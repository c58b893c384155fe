// Launcher liveness for the elastic (c10d) rendezvous: every launcher bumps a
// counter in the store, hb/<agent id>, from a background thread; every other
// launcher reads the counters and judges them by its own clock. A counter that
// has not moved for COHORT_HEARTBEAT_TIMEOUT means that launcher is gone (its
// process was killed, its host died, or its link is down).
//
// Judging by "has the value changed since I last saw it change" needs no
// synchronised clocks between hosts, only each observer's steady clock.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cohort/store.hpp"
#include "core/clock.hpp"

namespace cohort::launch {

// Pure bookkeeping of other launchers' heartbeat counters; no store, no thread.
// Single-threaded: the launcher's main thread owns it.
class LivenessTracker {
 public:
  explicit LivenessTracker(std::chrono::milliseconds timeout) : timeout_(timeout) {}

  // Records that `agent`'s counter reads `value` at `now`. The first sighting
  // and every change restart that agent's clock.
  void observe(long agent, int64_t value, core::Clock::time_point now);
  // Agents whose counter has not changed for the timeout, as of `now`.
  std::vector<long> lost(core::Clock::time_point now) const;
  // Seconds since `agent`'s counter last changed (0 when never observed).
  double silent_for(long agent, core::Clock::time_point now) const;
  void forget(long agent) { seen_.erase(agent); }
  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  struct Seen {
    int64_t value = 0;
    core::Clock::time_point changed_at;
  };
  std::chrono::milliseconds timeout_;
  std::map<long, Seen> seen_;
};

// The heartbeat key of one launcher.
std::string heartbeat_key(const std::string& prefix, long agent);

// Bumps heartbeat_key(prefix, agent) every `interval` on its own thread, over
// its own store connection (so the main thread's calls never delay it). Start
// it after the launcher's SignalChannel exists (the thread inherits the blocked
// signal mask). Store errors are logged once and retried: a launcher cut off
// from the store is judged by the others, not by itself.
class Heartbeat {
 public:
  Heartbeat(std::shared_ptr<Store> store, std::string key, std::chrono::milliseconds interval);
  ~Heartbeat();  // stops and joins the thread
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

 private:
  void loop();
  std::shared_ptr<Store> store_;
  std::string key_;
  std::chrono::milliseconds interval_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace cohort::launch
