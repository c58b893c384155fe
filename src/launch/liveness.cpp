#include "launch/liveness.hpp"

#include <fmt/format.h>

#include "core/log.hpp"

namespace cohort::launch {

void LivenessTracker::observe(long agent, int64_t value, core::Clock::time_point now) {
  auto it = seen_.find(agent);
  if (it == seen_.end()) {
    seen_[agent] = Seen{value, now};
  } else if (it->second.value != value) {
    it->second = Seen{value, now};
  }
}

std::vector<long> LivenessTracker::lost(core::Clock::time_point now) const {
  std::vector<long> out;
  for (const auto& [agent, s] : seen_)
    if (now - s.changed_at >= timeout_) out.push_back(agent);
  return out;
}

double LivenessTracker::silent_for(long agent, core::Clock::time_point now) const {
  auto it = seen_.find(agent);
  if (it == seen_.end()) return 0;
  return std::chrono::duration<double>(now - it->second.changed_at).count();
}

std::string heartbeat_key(const std::string& prefix, long agent) {
  return fmt::format("{}hb/{}", prefix, agent);
}

Heartbeat::Heartbeat(std::shared_ptr<Store> store, std::string key, std::chrono::milliseconds interval)
    : store_(std::move(store)), key_(std::move(key)), interval_(interval) {
  store_->add(key_, 1);  // the first beat before anyone looks
  thread_ = std::thread([this] { loop(); });
}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Heartbeat::loop() {
  bool warned = false;
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, interval_, [this] { return stop_; })) {
    lock.unlock();
    try {
      store_->add(key_, 1);
      warned = false;
    } catch (const std::exception& e) {
      if (!warned) COHORT_WARN(kLaunch, "heartbeat to the launcher's store failed: {}", e.what());
      warned = true;
    }
    lock.lock();
  }
}

}  // namespace cohort::launch
