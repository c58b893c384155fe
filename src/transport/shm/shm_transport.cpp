#include "transport/shm/shm_transport.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "cohort/error.hpp"
#include "core/env.hpp"
#include "core/log.hpp"
#include "transport/shm/shm_layout.hpp"

namespace cohort::transport {
namespace {

const core::Knob kSlotBytes{"COHORT_SHM_SLOT_BYTES", "128K",
                            "payload bytes per shared-memory FIFO slot (the pipelining unit on shm)", core::KnobKind::Bytes};
const core::Knob kNumSlots{"COHORT_SHM_NSLOTS", "8", "slots per shared-memory FIFO (per ordered pair of local ranks)",
                           core::KnobKind::Int};

std::string errno_str(int e) { return std::strerror(e); }

}  // namespace

int ShmTransport::Impl::local_of(int group_rank) const {
  auto it = std::find(opts.local_ranks.begin(), opts.local_ranks.end(), group_rank);
  return it == opts.local_ranks.end() ? -1 : static_cast<int>(it - opts.local_ranks.begin());
}

ShmTransport::ShmTransport(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ShmTransport::~ShmTransport() {
  if (impl_ && impl_->base != nullptr) munmap(impl_->base, impl_->mapped);
}

std::unique_ptr<ShmTransport> ShmTransport::open(const ShmOptions& opts, Store& store, core::Deadline deadline) {
  auto impl = std::make_unique<Impl>();
  impl->opts = opts;
  size_t slot = opts.slot_bytes ? opts.slot_bytes : kSlotBytes.bytes();
  size_t nslots = opts.nslots ? opts.nslots : static_cast<size_t>(kNumSlots.integer());
  if (slot < 64 || slot % 64 != 0)
    throw InvalidArgument(fmt::format("COHORT_SHM_SLOT_BYTES={} must be a multiple of 64 and at least 64", slot));
  if (nslots < 2) throw InvalidArgument(fmt::format("COHORT_SHM_NSLOTS={} must be at least 2", nslots));
  impl->layout = shm::Layout{opts.local_ranks.size(), slot, nslots};
  impl->my_local = impl->local_of(opts.my_rank);
  if (impl->my_local < 0) throw InvalidArgument("shm transport: this rank is not among the local ranks");

  const std::string path = "/" + opts.name;
  const size_t total = impl->layout.total();
  const bool leader = impl->my_local == 0;
  int fd = -1;
  if (leader) {
    shm_unlink(path.c_str());  // a stale segment from a crashed run with the same name
    fd = shm_open(path.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) throw IoError(fmt::format("shm_open({}) failed: {}", path, errno_str(errno)));
    if (ftruncate(fd, static_cast<off_t>(total)) != 0) {
      int e = errno;
      close(fd);
      shm_unlink(path.c_str());
      throw IoError(fmt::format("cannot size shared-memory segment {} to {} bytes: {}; HINT: is /dev/shm full? "
                                "(df -h /dev/shm; lower COHORT_SHM_SLOT_BYTES / COHORT_SHM_NSLOTS, or use COHORT_TRANSPORT=tcp)",
                                path, total, errno_str(e)));
    }
  }
  const std::string created_key = "shm/" + opts.name + "/created";
  if (leader) {
    void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) throw IoError(fmt::format("mmap of {} ({} bytes) failed: {}", path, total, errno_str(errno)));
    impl->base = static_cast<uint8_t*>(p);
    impl->mapped = total;
    auto* h = new (impl->base) shm::SegHeader{};
    h->magic = shm::kMagic;
    h->version = shm::kVersion;
    h->nlocal = static_cast<uint32_t>(opts.local_ranks.size());
    h->slot_bytes = slot;
    h->nslots = nslots;
    h->abort_rank.store(-1);
    for (size_t i = 0; i < opts.local_ranks.size(); ++i) new (impl->rank_ctl(i)) shm::RankCtl{};
    // FIFO memory is zero from ftruncate: tail = 0 and ready = 0 are the initial state.
    store.set_string(created_key, "1");
  } else {
    store.wait({created_key}, Millis(std::max(1, deadline.remaining_ms())));
    fd = shm_open(path.c_str(), O_RDWR, 0600);
    if (fd < 0) throw IoError(fmt::format("shm_open({}) to attach failed: {}", path, errno_str(errno)));
    void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) throw IoError(fmt::format("mmap of {} ({} bytes) failed: {}", path, total, errno_str(errno)));
    impl->base = static_cast<uint8_t*>(p);
    impl->mapped = total;
    auto* h = impl->header();
    if (h->magic != shm::kMagic || h->version != shm::kVersion || h->nlocal != opts.local_ranks.size() ||
        h->slot_bytes != slot || h->nslots != nslots)
      throw InvalidArgument(fmt::format(
          "shared-memory segment {} has a different layout (slots {}x{} B, {} ranks) than this rank expects "
          "({}x{} B, {} ranks); HINT: set COHORT_SHM_SLOT_BYTES / COHORT_SHM_NSLOTS the same on every rank",
          path, h->nslots, h->slot_bytes, h->nlocal, nslots, slot, opts.local_ranks.size()));
  }
  impl->rank_ctl(impl->my_local)->pid.store(getpid());

  // Once every local rank has mapped the segment, nobody needs its name: unlink
  // it, so that a crash cannot leave it behind.
  const std::string attached_key = fmt::format("shm/{}/attached/{}", opts.name, impl->my_local);
  store.set_string(attached_key, "1");
  std::vector<std::string> keys;
  for (size_t i = 0; i < opts.local_ranks.size(); ++i) keys.push_back(fmt::format("shm/{}/attached/{}", opts.name, i));
  store.wait(keys, Millis(std::max(1, deadline.remaining_ms())));
  if (leader) shm_unlink(path.c_str());
  COHORT_INFO(kNet, "shm segment {}: {} local ranks, {} slots x {} B per pair, {:.1f} MiB", path,
              opts.local_ranks.size(), nslots, slot, total / 1048576.0);
  return std::unique_ptr<ShmTransport>(new ShmTransport(std::move(impl)));
}

uint32_t ShmTransport::prepare_sleep() {
  auto* me = impl_->rank_ctl(impl_->my_local);
  me->sleeping.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return me->doorbell.load(std::memory_order_acquire);
}

void ShmTransport::sleep(uint32_t token, int timeout_us) {
  auto* me = impl_->rank_ctl(impl_->my_local);
  timespec ts{timeout_us / 1000000, (timeout_us % 1000000) * 1000L};
  // Shared (not FUTEX_PRIVATE) futex: the wakers are other processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&me->doorbell), FUTEX_WAIT, token, &ts, nullptr, 0);
}

void ShmTransport::finish_sleep() {
  impl_->rank_ctl(impl_->my_local)->sleeping.store(0, std::memory_order_relaxed);
}

int remove_stale_segments(const std::string& run_id) {
  if (run_id.empty()) return 0;
  const std::string prefix = "cohort-" + run_id + "-";
  int removed = 0;
  DIR* d = opendir("/dev/shm");
  if (d == nullptr) return 0;
  while (dirent* e = readdir(d)) {
    if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) {
      std::string path(1, '/');
      path += e->d_name;
      if (shm_unlink(path.c_str()) == 0) ++removed;
    }
  }
  closedir(d);
  return removed;
}

}  // namespace cohort::transport
