#include "transport/shm/shm_transport.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include <fmt/format.h>

#include "cohort/error.hpp"
#include "core/env.hpp"
#include "core/fd.hpp"
#include "core/log.hpp"
#include "transport/shm/shm_layout.hpp"

namespace cohort::transport {
namespace {

const core::Knob kSlotBytes{"COHORT_SHM_SLOT_BYTES", "128K",
                            "payload bytes per shared-memory FIFO slot (the pipelining unit on shm)", core::KnobKind::Bytes};
const core::Knob kNumSlots{"COHORT_SHM_NSLOTS", "8", "slots per shared-memory FIFO (per ordered pair of local ranks)",
                           core::KnobKind::Int};

std::string errno_str(int e) { return std::strerror(e); }

// What peers read to find out whether process_vm_readv works on this process.
constexpr uint64_t kProbeMagic = 0x59504f4333454c47ull;
volatile uint64_t g_probe_word = kProbeMagic;

// /proc/sys/kernel/yama/ptrace_scope, or "unknown".
std::string yama_ptrace_scope() {
  FILE* f = std::fopen("/proc/sys/kernel/yama/ptrace_scope", "r");
  int v = -1;
  if (f != nullptr) {
    if (std::fscanf(f, "%d", &v) != 1) v = -1;
    std::fclose(f);
  }
  return v < 0 ? std::string("unknown") : std::to_string(v);
}

// Reads the probe word of `pid` at `addr`, then writes the same value back:
// "" when both worked, else why not.
std::string probe_access(int pid, uint64_t addr) {
  uint64_t got = 0;
  iovec local{&got, sizeof got}, remote{reinterpret_cast<void*>(addr), sizeof got};
  ssize_t r = process_vm_readv(pid, &local, 1, &remote, 1, 0);
  if (r == static_cast<ssize_t>(sizeof got) && got == kProbeMagic) r = process_vm_writev(pid, &local, 1, &remote, 1, 0);
  if (r < 0) {
    int e = errno;
    if (e == EPERM)
      return fmt::format("process_vm_readv/writev of pid {} was refused (EPERM): /proc/sys/kernel/yama/ptrace_scope is {} or a "
                         "seccomp profile forbids it",
                         pid, yama_ptrace_scope());
    return fmt::format("process_vm_readv/writev of pid {} failed: {}", pid, errno_str(e));
  }
  if (r != static_cast<ssize_t>(sizeof got) || got != kProbeMagic)
    return fmt::format("process_vm_readv of pid {} read the wrong bytes", pid);
  return "";
}

// Every local rank publishes shm/<segment>/<what>/<local rank> and waits for all of them.
void local_barrier(Store& store, const ShmOptions& opts, size_t my_local, const char* what, core::Deadline deadline) {
  store.set_string(fmt::format("shm/{}/{}/{}", opts.name, what, my_local), "1");
  std::vector<std::string> keys;
  for (size_t i = 0; i < opts.local_ranks.size(); ++i) keys.push_back(fmt::format("shm/{}/{}/{}", opts.name, what, i));
  store.wait(keys, Millis(std::max(1, deadline.remaining_ms())));
}

}  // namespace

// After every local rank has published its pid and probe address: read every
// peer's probe word, publish the mask of those that worked, wait until every
// rank has, and switch single copy on only if every pair worked both ways.
void ShmTransport::Impl::probe_single_copy(Store& store, core::Deadline deadline) {
  const size_t n = layout.nlocal;
  std::string why;
  uint64_t mask = 0;
  if (!opts.single_copy) why = fmt::format("local rank {} opted out (COHORT_SINGLE_COPY_BYTES=0)", my_local);
  else if (n > 64) why = fmt::format("{} local ranks (single copy is probed for at most 64)", n);
  for (size_t i = 0; i < n && n <= 64 && opts.single_copy; ++i) {
    auto* rc = rank_ctl(i);
    if (static_cast<int>(i) == my_local) {
      mask |= uint64_t{1} << i;
      continue;
    }
    std::string e = probe_access(rc->pid.load(std::memory_order_acquire), rc->probe_addr.load(std::memory_order_acquire));
    if (e.empty()) mask |= uint64_t{1} << i;
    else if (why.empty()) why = fmt::format("local rank {} cannot read local rank {}: {}", my_local, i, e);
  }
  rank_ctl(my_local)->readable.store(mask, std::memory_order_release);
  local_barrier(store, opts, my_local, "probed", deadline);
  const uint64_t all = n >= 64 ? ~uint64_t{0} : (uint64_t{1} << n) - 1;
  for (size_t i = 0; i < n && why.empty(); ++i) {
    if ((rank_ctl(i)->readable.load(std::memory_order_acquire) & all) != all)
      why = fmt::format("local rank {} cannot access the memory of every other local rank, or opted out (its log says "
                        "why)",
                        i);
  }
  single_copy = why.empty();
  single_copy_why = why;
}

int ShmTransport::Impl::local_of(int group_rank) const {
  auto it = std::find(opts.local_ranks.begin(), opts.local_ranks.end(), group_rank);
  return it == opts.local_ranks.end() ? -1 : static_cast<int>(it - opts.local_ranks.begin());
}

ShmTransport::ShmTransport(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ShmTransport::~ShmTransport() = default;

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
  core::Fd fd;
  if (leader) {
    shm_unlink(path.c_str());  // a stale segment from a crashed run with the same name
    fd.reset(shm_open(path.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600));
    if (!fd.valid()) throw IoError(fmt::format("shm_open({}) failed: {}", path, errno_str(errno)));
    if (ftruncate(fd.get(), static_cast<off_t>(total)) != 0) {
      int e = errno;
      fd.reset();
      shm_unlink(path.c_str());
      throw IoError(fmt::format("cannot size shared-memory segment {} to {} bytes: {}; HINT: is /dev/shm full? "
                                "(df -h /dev/shm; lower COHORT_SHM_SLOT_BYTES / COHORT_SHM_NSLOTS, or use COHORT_TRANSPORT=tcp)",
                                path, total, errno_str(e)));
    }
  }
  const std::string created_key = "shm/" + opts.name + "/created";
  if (leader) {
    impl->segment = core::Mapping::shared(fd.get(), total);
    if (!impl->segment.valid())
      throw IoError(fmt::format("mmap of {} ({} bytes) failed: {}", path, total, errno_str(errno)));
    fd.reset();  // the mapping keeps the segment
    impl->base = impl->segment.data();
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
    fd.reset(shm_open(path.c_str(), O_RDWR, 0600));
    if (!fd.valid()) throw IoError(fmt::format("shm_open({}) to attach failed: {}", path, errno_str(errno)));
    impl->segment = core::Mapping::shared(fd.get(), total);
    if (!impl->segment.valid())
      throw IoError(fmt::format("mmap of {} ({} bytes) failed: {}", path, total, errno_str(errno)));
    fd.reset();
    impl->base = impl->segment.data();
    auto* h = impl->header();
    if (h->magic != shm::kMagic || h->version != shm::kVersion || h->nlocal != opts.local_ranks.size() ||
        h->slot_bytes != slot || h->nslots != nslots)
      throw InvalidArgument(fmt::format(
          "shared-memory segment {} has a different layout (slots {}x{} B, {} ranks) than this rank expects "
          "({}x{} B, {} ranks); HINT: set COHORT_SHM_SLOT_BYTES / COHORT_SHM_NSLOTS the same on every rank",
          path, h->nslots, h->slot_bytes, h->nlocal, nslots, slot, opts.local_ranks.size()));
  }
  // Yama's ptrace_scope 1 lets a process read only its descendants, unless it
  // names its reader: allow the other ranks of this job (same user) to read
  // ours, for single copy. EINVAL without Yama: nothing to allow.
  if (opts.single_copy) prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  impl->rank_ctl(impl->my_local)->probe_addr.store(reinterpret_cast<uint64_t>(const_cast<uint64_t*>(&g_probe_word)));
  impl->rank_ctl(impl->my_local)->pid.store(getpid());

  // Once every local rank has mapped the segment, nobody needs its name: unlink
  // it, so that a crash cannot leave it behind.
  local_barrier(store, opts, impl->my_local, "attached", deadline);
  if (leader) shm_unlink(path.c_str());
  impl->probe_single_copy(store, deadline);
  COHORT_INFO(kNet, "shm segment {}: {} local ranks, {} slots x {} B per pair, {:.1f} MiB; single copy (process_vm_readv) {}",
              path, opts.local_ranks.size(), nslots, slot, total / 1048576.0,
              impl->single_copy ? std::string("on") : "off: " + impl->single_copy_why);
  return std::unique_ptr<ShmTransport>(new ShmTransport(std::move(impl)));
}

bool ShmTransport::single_copy() const {
  return impl_->single_copy;
}

const std::string& ShmTransport::single_copy_unavailable_reason() const {
  return impl_->single_copy_why;
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

}  // namespace cohort::transport
