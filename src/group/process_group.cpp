// ProcessGroup's default members (backends override what they can do better).
#include <cstring>
#include <new>

#include "cohort/process_group.hpp"

namespace cohort {

std::shared_ptr<std::byte[]> ProcessGroup::allocate_buffer(size_t bytes) {
  constexpr std::align_val_t kAlign{64};
  auto* p = static_cast<std::byte*>(::operator new(std::max<size_t>(bytes, 1), kAlign));
  std::memset(p, 0, bytes);
  return std::shared_ptr<std::byte[]>(p, [](std::byte* q) { ::operator delete(q, kAlign); });
}

}  // namespace cohort
