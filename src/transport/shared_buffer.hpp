// Shared buffers: memory that other processes on this host can map.
//
// A buffer that a group reduces again and again (DDP's gradient buckets) can
// be allocated here instead of on the heap (ProcessGroup::allocate_buffer): a
// memfd of its own, mapped MAP_SHARED, registered process-wide. When a
// single-copy allreduce swaps buffer addresses, each rank also sends the
// SharedRef of its buffers; a peer opens /proc/<pid>/fd/<fd> (allowed by the
// same ptrace check as process_vm_readv), maps the buffer once and keeps the
// mapping. From then on that peer loads and stores the owner's bytes directly:
// no process_vm_readv/writev, so no copy through the kernel, no scratch buffer
// and no page pinning on every call.
//
// Lifetime: the owner's memory lives as long as any mapping of it. A peer
// keeps its mappings until its connection closes (the group shuts down) or
// kMaxMappings more recently used ones push them out, so memory freed by its
// owner may stay allocated until then; meant for long-lived buffers, not one
// per call. A crash leaves
// nothing behind (memfds have no name in the filesystem).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/mapping.hpp"

namespace cohort::transport {

// Identifies a shared buffer to a peer. Trivially copyable (exchanged as bytes).
struct SharedRef {
  uint64_t id = 0;    // unique in the owner's process, never reused; 0: not in a shared buffer
  uint64_t base = 0;  // the owner's address of the whole mapping
  uint64_t len = 0;   // bytes mapped
  int32_t fd = -1;    // the owner's descriptor of the memfd
  int32_t pad = 0;
};

// Allocates `bytes` (zeroed, page-aligned) of shared memory; freed when the
// last copy of the pointer goes. Throws IoError naming what failed (memfd
// limits, RLIMIT_NOFILE, memory).
std::shared_ptr<std::byte[]> allocate_shared_buffer(size_t bytes);

// The shared buffer holding all of [p, p + bytes), or a SharedRef with id 0.
SharedRef find_shared_buffer(const void* p, size_t bytes);

// A peer's shared buffers mapped into this process, by the owner's id.
class SharedMappings {
 public:
  static constexpr size_t kMaxMappings = 64;
  SharedMappings() = default;
  SharedMappings(const SharedMappings&) = delete;
  SharedMappings& operator=(const SharedMappings&) = delete;
  ~SharedMappings() = default;

  // This process's address for the owner's address `addr` inside `ref`, with
  // `bytes` from there inside the buffer; maps the buffer of process `pid` on
  // first use. nullptr when it cannot (ref.id 0, out of range, /proc/<pid>/fd
  // not accessible, mmap failed): the reason goes to *why.
  uint8_t* at(int pid, const SharedRef& ref, uint64_t addr, size_t bytes, std::string* why);

  // For tests: how many buffers are mapped, and whether the owner's `id` is.
  size_t size() const { return maps_.size(); }
  bool holds(uint64_t id) const;

 private:
  struct Mapped {
    uint64_t id;
    core::Mapping map;
  };
  std::vector<Mapped> maps_;  // least recently used first; past kMaxMappings the first is unmapped
};

}  // namespace cohort::transport
