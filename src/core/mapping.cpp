#include "core/mapping.hpp"

#include <sys/mman.h>

namespace cohort::core {

Mapping Mapping::shared(int fd, size_t len) {
  void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return Mapping();
  return Mapping(static_cast<uint8_t*>(p), len);
}

void Mapping::reset() {
  if (p_ != nullptr) ::munmap(p_, len_);
  p_ = nullptr;
  len_ = 0;
}

}  // namespace cohort::core
