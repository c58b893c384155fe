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
#include "core/fd.hpp"

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
  core::Fd fd(memfd_create("cohort-buffer", MFD_CLOEXEC));
  if (!fd.valid())
    throw IoError(fmt::format("allocate_buffer: memfd_create failed: {}; HINT: too many open files (ulimit -n)?",
                              std::strerror(errno)));
  if (ftruncate(fd.get(), static_cast<off_t>(len)) != 0)
    throw IoError(fmt::format("allocate_buffer: cannot size a shared buffer to {} bytes: {}", len, std::strerror(errno)));
  core::Mapping map = core::Mapping::shared(fd.get(), len);
  if (!map.valid())
    throw IoError(fmt::format("allocate_buffer: cannot map a shared buffer of {} bytes: {}", len, std::strerror(errno)));
  // The descriptor stays open for the buffer's life: peers open it through
  // /proc/<pid>/fd/<fd> to map the same memory (SharedMappings::at).
  struct Owned {
    core::Fd fd;
    core::Mapping map;
    Owned(core::Fd f, core::Mapping m) : fd(std::move(f)), map(std::move(m)) {}
    ~Owned() {
      Registry& reg = registry();
      std::lock_guard<std::mutex> g(reg.mu);
      reg.by_base.erase(reinterpret_cast<uint64_t>(map.data()));
    }
  };
  Registry& r = registry();
  {
    std::lock_guard<std::mutex> g(r.mu);
    SharedRef ref{.id = r.next_id++, .base = reinterpret_cast<uint64_t>(map.data()), .len = len, .fd = fd.get()};
    r.by_base[ref.base] = ref;
  }
  auto owned = std::make_shared<Owned>(std::move(fd), std::move(map));
  return std::shared_ptr<std::byte[]>(owned, reinterpret_cast<std::byte*>(owned->map.data()));
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
  for (const Mapped& m : maps_)
    if (m.id == id) return true;
  return false;
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
    if (!inside(ref.base, maps_[k].map.size(), addr, bytes)) {
      *why = fmt::format("{} bytes at {:#x} are outside the {} bytes mapped of that shared buffer", bytes, addr,
                         maps_[k].map.size());
      return nullptr;
    }
    // Most recently used last: an allreduce maps its send and its receive
    // buffer one after the other, and mapping the second must not evict the first.
    Mapped m = std::move(maps_[k]);
    maps_.erase(maps_.begin() + static_cast<ptrdiff_t>(k));
    uint8_t* at = m.map.data() + (addr - ref.base);
    maps_.push_back(std::move(m));
    return at;
  }

  const std::string path = fmt::format("/proc/{}/fd/{}", pid, ref.fd);
  const core::Fd fd(open(path.c_str(), O_RDWR | O_CLOEXEC));
  if (!fd.valid()) {
    *why = fmt::format("cannot open {}: {}", path, std::strerror(errno));
    return nullptr;
  }
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) {
    *why = fmt::format("cannot stat {}: {}", path, std::strerror(errno));
    return nullptr;
  }
  if (static_cast<uint64_t>(st.st_size) != ref.len) {
    *why = fmt::format("{} is not the shared buffer announced ({} bytes, expected {})", path,
                       static_cast<long long>(st.st_size), ref.len);
    return nullptr;
  }
  core::Mapping map = core::Mapping::shared(fd.get(), ref.len);  // the mapping keeps the memory once fd closes
  if (!map.valid()) {
    *why = fmt::format("cannot map {} ({} bytes): {}", path, ref.len, std::strerror(errno));
    return nullptr;
  }
  if (maps_.size() >= kMaxMappings) maps_.erase(maps_.begin());
  uint8_t* at = map.data() + (addr - ref.base);
  maps_.push_back({ref.id, std::move(map)});
  return at;
}

}  // namespace cohort::transport
