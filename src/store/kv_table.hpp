// store/kv_table.hpp: the key-value semantics every store shares, and the
// wording of their errors.
//
// KvTable is the single place that decides what set / add / compare_set /
// delete mean, so that MemoryStore and TcpStoreServer cannot drift apart.
// It is not thread-safe: MemoryStore calls it under its mutex, the server only
// from its event-loop thread. It never blocks; waiting is the caller's job.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "cohort/store.hpp"
#include "core/clock.hpp"

namespace cohort::store {

class KvTable {
 public:
  // nullptr when missing. The pointer is valid until the next mutation.
  const Bytes* find(const std::string& key) const;
  bool contains(const std::string& key) const { return map_.count(key) != 0; }
  void set(const std::string& key, Bytes value);
  // Counters are stored as decimal ASCII ("42"), as in c10d, so get() of a
  // counter reads as text. Throws InvalidArgument naming the key when the
  // stored value is not a decimal int64, or when the sum overflows.
  int64_t add(const std::string& key, int64_t delta);
  // Store::compare_set. *stored says whether desired was written (the caller
  // then wakes whoever waits on key).
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired, bool* stored);
  bool erase(const std::string& key);
  int64_t size() const { return static_cast<int64_t>(map_.size()); }
  // The keys of `keys` that do not exist, in the given order.
  std::vector<std::string> missing(const std::vector<std::string>& keys) const;
  // The first key of `keys` that does not exist, or nullptr.
  const std::string* first_missing(const std::vector<std::string>& keys) const;

 private:
  std::unordered_map<std::string, Bytes> map_;
};

// "a, b, c"; past 16 keys it ends with "... and N more" so that a wait on a
// thousand ranks' keys still gives a readable message.
std::string join_keys(const std::vector<std::string>& keys);
// "[a, b, c]", the same list in brackets.
std::string format_keys(const std::vector<std::string>& keys);

// The TimeoutError text of a get() or wait(), shared by every store, e.g.
//   store wait timed out after 300 ms for keys [a, b] (missing: b) on 127.0.0.1:29501; HINT: ...
//   store get timed out after 300 ms waiting for key a on MemoryStore; HINT: ...
std::string wait_timeout_message(std::string_view op, const std::vector<std::string>& keys,
                                 const std::vector<std::string>& missing, Millis timeout, std::string_view where);

// The deadline of a user-given timeout. A negative timeout counts as zero (look
// once, do not wait); a huge one is clamped so that time arithmetic cannot overflow.
core::Deadline deadline_after(Millis timeout);

}  // namespace cohort::store
