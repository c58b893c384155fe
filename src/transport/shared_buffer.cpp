// Shared buffers (shared_buffer.hpp): memfd-backed allocations, a registry
// of them for find_shared_buffer, and a peer's cache of mapped buffers.
#include "transport/shared_buffer.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>

#include <fmt/format.h>

#include "cohort/error.hpp"

namespace cohort::transport {

namespace {

struct Registry {
  std::mutex mu;
  std::map<uint64_t, SharedRef> by_base;  // owner's buffers by base address
  uint64_t next_id = 1;
};
Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: buffers may outlive static destruction
  return *r;
}

// [addr, addr + bytes) lies inside [base, base + len) (unsigned: addr < base wraps to "outside").
bool inside(uint64_t base, uint64_t len, uint64_t addr, size_t bytes) {
  return addr - base <= len && bytes <= len - (addr - base);
}

}  // namespace

std::shared_ptr<std::byte[]> allocate_shared_buffer(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t len = std::max(page, (bytes + page - 1) / page * page);
  const int fd = memfd_create("cohort-buffer", MFD_CLOEXEC);
  if (fd < 0)
    throw IoError(fmt::format("allocate_buffer: memfd_create failed: {}; HINT: too many open files (ulimit -n)?",
                              std::strerror(errno)));
  if (ftruncate(fd, static_cast<off_t>(len)) != 0) {
    const int e = errno;
    close(fd);
    throw IoError(fmt::format("allocate_buffer: cannot size a shared buffer to {} bytes: {}", len, std::strerror(e)));
  }
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int e = errno;
    close(fd);
    throw IoError(fmt::format("allocate_buffer: cannot map a shared buffer of {} bytes: {}", len, std::strerror(e)));
  }
  Registry& r = registry();
  {
    std::lock_guard<std::mutex> g(r.mu);
    SharedRef ref{.id = r.next_id++, .base = reinterpret_cast<uint64_t>(p), .len = len, .fd = fd};
    r.by_base[ref.base] = ref;
  }
  return std::shared_ptr<std::byte[]>(static_cast<std::byte*>(p), [fd, len](std::byte* q) {
    {
      Registry& reg = registry();
      std::lock_guard<std::mutex> g(reg.mu);
      reg.by_base.erase(reinterpret_cast<uint64_t>(q));
    }
    munmap(q, len);
    close(fd);
  });
}

SharedRef find_shared_buffer(const void* p, size_t bytes) {
  const uint64_t a = reinterpret_cast<uint64_t>(p);
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  auto it = r.by_base.upper_bound(a);
  if (it == r.by_base.begin()) return {};
  --it;
  return inside(it->second.base, it->second.len, a, bytes) ? it->second : SharedRef{};
}

bool SharedMappings::holds(uint64_t id) const {
  for (const Mapping& m : maps_)
    if (m.id == id) return true;
  return false;
}

SharedMappings::~SharedMappings() {
  for (const Mapping& m : maps_) munmap(m.p, m.len);
}

uint8_t* SharedMappings::at(int pid, const SharedRef& ref, uint64_t addr, size_t bytes, std::string* why) {
  if (ref.id == 0) {
    *why = "not a shared buffer";
    return nullptr;
  }
  if (!inside(ref.base, ref.len, addr, bytes)) {
    *why = fmt::format("{} bytes at {:#x} are not inside its shared buffer [{:#x}, +{})", bytes, addr, ref.base, ref.len);
    return nullptr;
  }
  for (size_t k = 0; k < maps_.size(); ++k) {
    if (maps_[k].id != ref.id) continue;
    const Mapping m = maps_[k];
    if (!inside(ref.base, m.len, addr, bytes)) {
      *why = fmt::format("{} bytes at {:#x} are outside the {} bytes mapped of that shared buffer", bytes, addr, m.len);
      return nullptr;
    }
    // Most recently used last: an allreduce maps its send and its receive
    // buffer one after the other, and mapping the second must not evict the first.
    maps_.erase(maps_.begin() + static_cast<ptrdiff_t>(k));
    maps_.push_back(m);
    return m.p + (addr - ref.base);
  }

  const std::string path = fmt::format("/proc/{}/fd/{}", pid, ref.fd);
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    *why = fmt::format("cannot open {}: {}", path, std::strerror(errno));
    return nullptr;
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    *why = fmt::format("cannot stat {}: {}", path, std::strerror(errno));
    close(fd);
    return nullptr;
  }
  if (static_cast<uint64_t>(st.st_size) != ref.len) {
    *why = fmt::format("{} is not the shared buffer announced ({} bytes, expected {})", path,
                       static_cast<long long>(st.st_size), ref.len);
    close(fd);
    return nullptr;
  }
  void* p = mmap(nullptr, ref.len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int e = errno;
  close(fd);  // the mapping keeps the memory
  if (p == MAP_FAILED) {
    *why = fmt::format("cannot map {} ({} bytes): {}", path, ref.len, std::strerror(e));
    return nullptr;
  }
  if (maps_.size() >= kMaxMappings) {
    munmap(maps_.front().p, maps_.front().len);
    maps_.erase(maps_.begin());
  }
  maps_.push_back({ref.id, static_cast<uint8_t*>(p), ref.len});
  return static_cast<uint8_t*>(p) + (addr - ref.base);
}

}  // namespace cohort::transport
