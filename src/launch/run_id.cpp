#include "launch/run_id.hpp"

#include <filesystem>
#include <random>

#include "core/log.hpp"

namespace cohort::launch {

std::string random_hex(int digits) {
  static const char* kHex = "0123456789abcdef";
  std::random_device rd;  // /dev/urandom: distinct across processes started in the same instant
  std::string out;
  while (static_cast<int>(out.size()) < digits) {
    unsigned v = rd();
    for (int i = 0; i < 8 && static_cast<int>(out.size()) < digits; ++i, v >>= 4) out.push_back(kHex[v & 15]);
  }
  return out;
}

std::string make_cohort_run_id(const std::string& run_id) {
  std::string base = run_id == "none" || run_id.empty() ? "job" : run_id.substr(0, 24);
  for (char& c : base) {
    bool safe = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.' ||
                c == '-';
    if (!safe) c = '_';
  }
  return base + "-" + random_hex(16);  // 64 random bits: shm segment names cannot be guessed
}

int remove_shm_segments(const std::string& cohort_run_id, const std::string& shm_dir) {
  const std::string prefix = "cohort-" + cohort_run_id + "-";
  int removed = 0;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(shm_dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::string name = it->path().filename().string();
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    std::error_code rm;
    if (std::filesystem::remove(it->path(), rm)) ++removed;
    else if (rm) COHORT_WARN(kLaunch, "could not remove {}: {}", it->path().string(), rm.message());
  }
  if (removed > 0) COHORT_INFO(kLaunch, "removed {} shared-memory segment(s) {}/{}*", removed, shm_dir, prefix);
  return removed;
}

}  // namespace cohort::launch
