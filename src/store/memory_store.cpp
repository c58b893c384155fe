// MemoryStore: one KvTable behind a mutex; blocked get()/wait() callers sleep
// on a condition variable that every write which creates or replaces a key
// notifies. For tests and single-process runs where ranks are threads.
#include <condition_variable>
#include <mutex>

#include "cohort/error.hpp"
#include "cohort/store.hpp"
#include "store/kv_table.hpp"

namespace cohort {

struct MemoryStore::State {
  std::mutex mu;
  std::condition_variable changed;  // notified after any write that may satisfy a waiter
  store::KvTable table;

  // Blocks (mu held by `lock`) until every key exists or the deadline passes.
  // Returns the keys still missing (empty on success).
  std::vector<std::string> wait_locked(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys,
                                       Millis timeout) {
    auto deadline = store::deadline_after(timeout);
    while (table.first_missing(keys) != nullptr) {
      if (changed.wait_until(lock, deadline.at) == std::cv_status::timeout) break;
    }
    return table.missing(keys);
  }
};

MemoryStore::MemoryStore() : state_(std::make_unique<State>()) {}
MemoryStore::~MemoryStore() = default;

void MemoryStore::set(const std::string& key, const Bytes& value) {
  {
    std::lock_guard<std::mutex> g(state_->mu);
    state_->table.set(key, value);
  }
  state_->changed.notify_all();
}

Bytes MemoryStore::get(const std::string& key, Millis timeout) {
  std::unique_lock<std::mutex> lock(state_->mu);
  auto missing = state_->wait_locked(lock, {key}, timeout);
  if (!missing.empty()) throw TimeoutError(store::wait_timeout_message("get", {key}, missing, timeout, "MemoryStore"));
  return *state_->table.find(key);
}

int64_t MemoryStore::add(const std::string& key, int64_t delta) {
  int64_t v;
  {
    std::lock_guard<std::mutex> g(state_->mu);
    v = state_->table.add(key, delta);
  }
  state_->changed.notify_all();
  return v;
}

Bytes MemoryStore::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  bool stored = false;
  Bytes now;
  {
    std::lock_guard<std::mutex> g(state_->mu);
    now = state_->table.compare_set(key, expected, desired, &stored);
  }
  if (stored) state_->changed.notify_all();
  return now;
}

void MemoryStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  std::unique_lock<std::mutex> lock(state_->mu);
  auto missing = state_->wait_locked(lock, keys, timeout);
  if (!missing.empty()) throw TimeoutError(store::wait_timeout_message("wait", keys, missing, timeout, "MemoryStore"));
}

bool MemoryStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> g(state_->mu);
  return state_->table.first_missing(keys) == nullptr;
}

bool MemoryStore::delete_key(const std::string& key) {
  std::lock_guard<std::mutex> g(state_->mu);
  return state_->table.erase(key);
}

int64_t MemoryStore::num_keys() {
  std::lock_guard<std::mutex> g(state_->mu);
  return state_->table.size();
}

}  // namespace cohort
