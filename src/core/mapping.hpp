// core::Mapping: owns one mmap'ed region and unmaps it exactly once, whatever
// path leaves the scope (a throw included). With core::Fd, the one way cohort
// holds what the kernel hands out: shared-memory segments, shared buffers and
// the peers' buffers mapped into this process.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cohort::core {

class Mapping {
 public:
  Mapping() = default;
  // Maps `len` bytes of `fd` from offset 0, read-write and shared (what every
  // mapping in cohort is). Check valid(); errno then says why not.
  static Mapping shared(int fd, size_t len);
  ~Mapping() { reset(); }
  Mapping(Mapping&& o) noexcept : p_(o.p_), len_(o.len_) { o.p_ = nullptr, o.len_ = 0; }
  Mapping& operator=(Mapping&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = o.p_, len_ = o.len_;
      o.p_ = nullptr, o.len_ = 0;
    }
    return *this;
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  uint8_t* data() const { return p_; }
  size_t size() const { return len_; }
  bool valid() const { return p_ != nullptr; }
  // Unmaps the region (if any).
  void reset();

 private:
  Mapping(uint8_t* p, size_t len) : p_(p), len_(len) {}
  uint8_t* p_ = nullptr;
  size_t len_ = 0;
};

}  // namespace cohort::core
