#include "checkpoint/agree.hpp"

#include <algorithm>
#include <cstdint>

namespace cohort::ckpt {

std::vector<std::string> allgather_strings(ProcessGroup& group, const std::string& mine) {
  const size_t n = static_cast<size_t>(group.size());
  int64_t my_len = static_cast<int64_t>(mine.size());
  std::vector<int64_t> lens(n);
  group.allgather(Buffer{&my_len, 1, DType::I64}, Buffer{lens.data(), n, DType::I64})->wait();
  const size_t longest = static_cast<size_t>(*std::max_element(lens.begin(), lens.end()));
  std::vector<std::string> out(n);
  if (longest == 0) return out;
  std::vector<uint8_t> send(longest), all(longest * n);
  std::copy(mine.begin(), mine.end(), send.begin());
  group.allgather(Buffer{send.data(), longest, DType::U8}, Buffer{all.data(), longest * n, DType::U8})->wait();
  for (size_t r = 0; r < n; ++r)
    out[r].assign(reinterpret_cast<const char*>(all.data() + r * longest), static_cast<size_t>(lens[r]));
  return out;
}

std::string broadcast_string(ProcessGroup& group, const std::string& mine, int root) {
  int64_t len = static_cast<int64_t>(mine.size());
  group.broadcast(Buffer{&len, 1, DType::I64}, {.root = root})->wait();
  std::string out = group.rank() == root ? mine : std::string(static_cast<size_t>(len), '\0');
  if (len > 0) group.broadcast(Buffer{out.data(), static_cast<size_t>(len), DType::U8}, {.root = root})->wait();
  return out;
}

std::pair<int, std::string> first_error(ProcessGroup& group, const std::string& mine) {
  const std::vector<std::string> all = allgather_strings(group, mine);
  for (size_t r = 0; r < all.size(); ++r)
    if (!all[r].empty()) return {static_cast<int>(r), all[r]};
  return {-1, {}};
}

}  // namespace cohort::ckpt
