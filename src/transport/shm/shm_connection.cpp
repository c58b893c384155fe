// ShmConnection: the Connection to one other rank on this host (protocol in shm_transport.hpp).
#include <linux/futex.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

#include <fmt/format.h>

#include "cohort/error.hpp"
#include "transport/shm/shm_layout.hpp"

namespace cohort::transport {
namespace {

using shm::FifoCtl;
using shm::kInlineBytes;
using shm::RankCtl;
using shm::SlotHdr;

class ShmConnection final : public Connection {
 public:
  ShmConnection(ShmTransport::Impl* t, int peer_rank)
      : Connection(peer_rank), t_(t), peer_local_(t->local_of(peer_rank)) {
    const auto& L = t->layout;
    nslots_ = L.nslots;
    slot_bytes_ = L.slot_bytes;
    stride_ = L.slot_stride();
    out_ = t->fifo(t->my_local, peer_local_);
    in_ = t->fifo(peer_local_, t->my_local);
    them_ = t->rank_ctl(peer_local_);
  }

  Kind kind() const override { return Kind::Shm; }

  bool progress_send(SendOp& op) override {
    bool moved = false;
    auto* ctl = reinterpret_cast<FifoCtl*>(out_);
    while (!op.complete) {
      if (sent_ - tail_cache_ >= nslots_) {
        tail_cache_ = ctl->tail.load(std::memory_order_acquire);
        if (sent_ - tail_cache_ >= nslots_) break;
      }
      auto* slot = slot_at(out_, sent_);
      size_t len = std::min(slot_bytes_, op.bytes - op.done);
      slot->seq = op.key.seq;
      slot->tag = op.key.tag;
      slot->kind = op.key.kind;
      slot->count = op.key.count;
      slot->msg_bytes = op.bytes;
      slot->offset = op.done;
      slot->len = static_cast<uint32_t>(len);
      if (len > 0) std::memcpy(len <= kInlineBytes ? slot->inline_data : payload(slot), op.data + op.done, len);
      slot->ready.store(sent_ + 1, std::memory_order_release);
      ++sent_;
      op.done += len;
      moved = true;
      if (op.done == op.bytes) op.complete = true;
    }
    if (moved) ring(them_);
    return moved;
  }

  bool progress_recv(RecvOp& op) override {
    bool moved = false;
    auto* ctl = reinterpret_cast<FifoCtl*>(in_);
    while (!op.complete) {
      auto* slot = slot_at(in_, recvd_);
      if (slot->ready.load(std::memory_order_acquire) != recvd_ + 1) break;
      if (slot->seq != op.key.seq || slot->tag != op.key.tag || slot->kind != op.key.kind ||
          slot->count != op.key.count || slot->msg_bytes != op.bytes || slot->offset != op.done || slot->len > op.bytes - op.done)
        throw_mismatch(op, *slot);
      const uint8_t* data = slot->len <= kInlineBytes ? slot->inline_data : payload(slot);
      op.sink.deliver(data, op.done, slot->len);
      op.done += slot->len;
      ++recvd_;
      ctl->tail.store(recvd_, std::memory_order_release);
      moved = true;
      if (op.done == op.bytes) op.complete = true;
    }
    if (moved) ring(them_);
    return moved;
  }

  void check_alive() override {
    auto* h = t_->header();
    int ab = h->abort_rank.load(std::memory_order_acquire);
    if (ab >= 0) {
      throw PeerError(fmt::format("rank {} aborted the group: {}", ab,
                                  std::string(h->abort_reason, strnlen(h->abort_reason, sizeof(h->abort_reason)))),
                      ab);
    }
    int pid = them_->pid.load(std::memory_order_relaxed);
    if (pid > 0 && pid != getpid() && kill(pid, 0) != 0 && errno == ESRCH)
      throw PeerError(fmt::format("{} died (its process no longer exists)", describe()), peer_);
  }

  void abort(const std::string& why) noexcept override {
    auto* h = t_->header();
    int expected = -1;
    int mine = t_->opts.my_rank;
    if (h->abort_rank.compare_exchange_strong(expected, mine)) {
      size_t n = std::min(why.size(), sizeof(h->abort_reason) - 1);
      std::memcpy(h->abort_reason, why.data(), n);
      h->abort_reason[n] = '\0';
      std::atomic_thread_fence(std::memory_order_seq_cst);
    }
    // Wake every local rank so that it checks the abort record now.
    for (size_t i = 0; i < t_->layout.nlocal; ++i) {
      auto* rc = t_->rank_ctl(i);
      rc->doorbell.fetch_add(1);
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&rc->doorbell), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
    }
  }

  void read_remote(uint64_t remote, void* local, size_t bytes) override {
    access_remote(remote, static_cast<uint8_t*>(local), bytes, false);
  }
  void write_remote(uint64_t remote, const void* local, size_t bytes) override {
    access_remote(remote, static_cast<uint8_t*>(const_cast<void*>(local)), bytes, true);
  }

  uint8_t* map_remote(const SharedRef& ref, uint64_t remote, size_t bytes, std::string* why) override {
    if (!t_->single_copy) {
      *why = "single copy is off in this group";
      return nullptr;
    }
    return mapped_.at(them_->pid.load(std::memory_order_relaxed), ref, remote, bytes, why);
  }

  std::string describe() const override {
    return fmt::format("rank {} (pid {}, shm)", peer_, them_->pid.load(std::memory_order_relaxed));
  }

 private:
  SlotHdr* slot_at(uint8_t* fifo, uint64_t counter) const {
    return reinterpret_cast<SlotHdr*>(fifo + sizeof(FifoCtl) + (counter % nslots_) * stride_);
  }
  static uint8_t* payload(SlotHdr* s) { return reinterpret_cast<uint8_t*>(s) + sizeof(SlotHdr); }

  // Wake `who` if it announced that it may sleep (Dekker-style: our publish,
  // then a full fence, then read its flag; it sets its flag, fences, re-checks).
  static void ring(RankCtl* who) {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (who->sleeping.load(std::memory_order_relaxed) != 0) {
      who->doorbell.fetch_add(1, std::memory_order_release);
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&who->doorbell), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
    }
  }

  [[noreturn]] void throw_mismatch(const RecvOp& op, const SlotHdr& s) const {
    MsgKey got{s.seq, s.tag, s.kind, s.count};
    throw MessageMismatch(
        fmt::format("{} sent message #{} (tag {:#x}, count {}) of {} bytes at offset {}, but this rank expected #{} "
                    "(tag {:#x}, count {}) of {} bytes at offset {}",
                    describe(), s.seq, s.tag, s.count, s.msg_bytes, s.offset, op.key.seq, op.key.tag, op.key.count, op.bytes,
                    op.done),
        peer_, got, s.msg_bytes, op.key, op.bytes);
  }

  // process_vm_readv / writev until every byte moved (they may move less).
  void access_remote(uint64_t remote, uint8_t* local, size_t bytes, bool write) {
    if (!t_->single_copy) Connection::read_remote(remote, local, bytes);  // throws: not allowed here
    const int pid = them_->pid.load(std::memory_order_relaxed);
    while (bytes > 0) {
      iovec l{local, bytes}, r{reinterpret_cast<void*>(remote), bytes};
      ssize_t got = write ? process_vm_writev(pid, &l, 1, &r, 1, 0) : process_vm_readv(pid, &l, 1, &r, 1, 0);
      if (got <= 0) {
        const int e = got < 0 ? errno : EFAULT;
        check_alive();  // a dead or aborted peer says so first
        if (e == ESRCH) throw PeerError(fmt::format("{} died (its process no longer exists)", describe()), peer_);
        throw PeerError(fmt::format("cannot {} {} bytes of {}'s memory at {:#x}: {}; HINT: a buffer freed or resized "
                                    "while its collective was still running?",
                                    write ? "write" : "read", bytes, describe(), remote, std::strerror(e)),
                        peer_);
      }
      local += got;
      remote += static_cast<uint64_t>(got);
      bytes -= static_cast<size_t>(got);
    }
  }

  ShmTransport::Impl* t_;
  int peer_local_;
  size_t nslots_, slot_bytes_, stride_;
  uint8_t* out_;
  uint8_t* in_;
  RankCtl* them_;
  uint64_t sent_ = 0;
  uint64_t tail_cache_ = 0;
  uint64_t recvd_ = 0;
  SharedMappings mapped_;  // the peer's shared buffers mapped here (map_remote)
};

}  // namespace

std::unique_ptr<Connection> ShmTransport::connect(int peer_rank) {
  if (impl_->local_of(peer_rank) < 0) throw InvalidArgument(fmt::format("shm transport: rank {} is not on this host", peer_rank));
  return std::make_unique<ShmConnection>(impl_.get(), peer_rank);
}

}  // namespace cohort::transport
