#include "store/kv_table.hpp"

#include <algorithm>
#include <charconv>

#include <fmt/format.h>

#include "cohort/error.hpp"

namespace cohort::store {

const Bytes* KvTable::find(const std::string& key) const {
  auto it = map_.find(key);
  return it == map_.end() ? nullptr : &it->second;
}

void KvTable::set(const std::string& key, Bytes value) { map_[key] = std::move(value); }

int64_t KvTable::add(const std::string& key, int64_t delta) {
  int64_t current = 0;
  auto it = map_.find(key);
  if (it != map_.end()) {
    const Bytes& v = it->second;
    const char* first = reinterpret_cast<const char*>(v.data());
    const char* last = first + v.size();
    auto [end, ec] = std::from_chars(first, last, current);
    if (v.empty() || ec != std::errc() || end != last) {
      std::string shown(first, std::min<size_t>(v.size(), 32));
      throw InvalidArgument(fmt::format(
          "store add: key '{}' holds \"{}\"{}, which is not a decimal integer; "
          "HINT: add() only works on keys that are missing or were written by add() or set to a number like \"42\"; "
          "use a separate key for the counter",
          key, shown, v.size() > 32 ? fmt::format("... ({} bytes)", v.size()) : ""));
    }
  }
  int64_t sum = 0;
  if (__builtin_add_overflow(current, delta, &sum))
    throw InvalidArgument(fmt::format("store add: key '{}' holds {} and adding {} overflows int64; "
                                      "HINT: reset the counter or use smaller steps", key, current, delta));
  std::string text = std::to_string(sum);
  map_[key] = Bytes(text.begin(), text.end());
  return sum;
}

Bytes KvTable::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired, bool* stored) {
  *stored = false;
  auto it = map_.find(key);
  if (it == map_.end()) {
    if (!expected.empty()) return expected;  // c10d: a missing key "holds" the caller's expectation
    map_.emplace(key, desired);
    *stored = true;
    return desired;
  }
  if (it->second != expected) return it->second;
  it->second = desired;
  *stored = true;
  return desired;
}

bool KvTable::erase(const std::string& key) { return map_.erase(key) != 0; }

std::vector<std::string> KvTable::missing(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  for (const auto& k : keys)
    if (!contains(k)) out.push_back(k);
  return out;
}

const std::string* KvTable::first_missing(const std::vector<std::string>& keys) const {
  for (const auto& k : keys)
    if (!contains(k)) return &k;
  return nullptr;
}

std::string join_keys(const std::vector<std::string>& keys) {
  constexpr size_t kShown = 16;
  std::string s;
  for (size_t i = 0; i < keys.size() && i < kShown; ++i) {
    if (i) s += ", ";
    s += keys[i];
  }
  if (keys.size() > kShown) s += fmt::format(", ... and {} more", keys.size() - kShown);
  return s;
}

std::string format_keys(const std::vector<std::string>& keys) {
  std::string s = "[";  // not "[" + join_keys(): GCC 12 gives a false -Wrestrict on that
  s += join_keys(keys);
  s += ']';
  return s;
}

std::string wait_timeout_message(std::string_view op, const std::vector<std::string>& keys,
                                 const std::vector<std::string>& missing, Millis timeout, std::string_view where) {
  constexpr const char* kHint =
      "HINT: the rank(s) that should set them have not got there yet: they may be slower, stuck or dead "
      "(look at their logs first); if they are just slow, raise the timeout (COHORT_TIMEOUT for a process "
      "group's set-up, or the call's argument / Store::set_timeout in your own code)";
  if (keys.size() == 1 && missing.size() <= 1)
    return fmt::format("store {} timed out after {} ms waiting for key {} on {}; {}", op, timeout.count(), keys[0],
                       where, kHint);
  return fmt::format("store {} timed out after {} ms for keys {} (missing: {}) on {}; {}", op, timeout.count(),
                     format_keys(keys), missing.empty() ? std::string("none") : join_keys(missing), where, kHint);
}

core::Deadline deadline_after(Millis timeout) {
  constexpr Millis kMax = std::chrono::hours(24 * 365 * 100);  // far past any real job, far from overflow
  if (timeout < Millis::zero()) timeout = Millis::zero();
  if (timeout > kMax) timeout = kMax;
  return core::Deadline::after(timeout);
}

}  // namespace cohort::store
