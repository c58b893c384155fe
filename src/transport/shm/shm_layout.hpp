// Memory layout of a shared-memory segment (see shm_transport.hpp for the protocol).
// Everything here lives in memory mapped by several processes: only
// lock-free atomics and plain bytes, no pointers.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/mapping.hpp"
#include "transport/shm/shm_transport.hpp"

namespace cohort::transport::shm {

inline constexpr uint64_t kMagic = 0x31474553544f4843ull;  // "COHTSEG1"
inline constexpr uint32_t kVersion = 2;
inline constexpr size_t kInlineBytes = 8;

struct alignas(64) SegHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t nlocal;
  uint64_t slot_bytes;
  uint64_t nslots;
  alignas(64) std::atomic<int32_t> abort_rank;  // group rank that aborted first, or -1
  char abort_reason[448];
};

struct alignas(64) RankCtl {
  std::atomic<int32_t> pid;
  // Single copy (shm_transport.cpp, probe_single_copy): the address of a word
  // holding a known value in this process, for peers to read and write with
  // process_vm_readv/writev; then a bit per local rank whose word this rank
  // could access (final once this rank passed the "probed" store barrier).
  std::atomic<uint64_t> probe_addr;
  std::atomic<uint64_t> readable;
  alignas(64) std::atomic<uint32_t> doorbell;  // futex word: bumped by peers that want us awake
  alignas(64) std::atomic<uint32_t> sleeping;  // 1 while this rank may be asleep on doorbell
};

struct alignas(64) FifoCtl {
  std::atomic<uint64_t> tail;  // slots consumed by the receiver
};

struct alignas(64) SlotHdr {
  std::atomic<uint64_t> ready;  // = (slot counter + 1) once published
  uint64_t seq;
  uint64_t msg_bytes;
  uint64_t offset;
  uint32_t len;
  uint32_t tag;
  uint32_t kind;
  uint32_t pad;
  uint64_t count;
  uint8_t inline_data[kInlineBytes];
};
static_assert(sizeof(SlotHdr) == 64);
static_assert(sizeof(SegHeader) % 64 == 0);

struct Layout {
  size_t nlocal, slot_bytes, nslots;
  size_t slot_stride() const { return sizeof(SlotHdr) + slot_bytes; }
  size_t fifo_bytes() const { return sizeof(FifoCtl) + nslots * slot_stride(); }
  size_t ranks_offset() const { return sizeof(SegHeader); }
  size_t fifos_offset() const { return ranks_offset() + nlocal * sizeof(RankCtl); }
  size_t fifo_offset(size_t from, size_t to) const { return fifos_offset() + (from * nlocal + to) * fifo_bytes(); }
  size_t total() const { return fifos_offset() + nlocal * nlocal * fifo_bytes(); }
};

}  // namespace cohort::transport::shm

namespace cohort::transport {

struct ShmTransport::Impl {
  ShmOptions opts;
  shm::Layout layout{};
  core::Mapping segment;   // the whole segment, unmapped when the transport goes
  uint8_t* base = nullptr;  // segment.data()
  int my_local = 0;
  bool single_copy = false;        // every local rank can read every other's memory
  std::string single_copy_why;     // why not, for the log and for COHORT_ALGO=single_copy

  shm::SegHeader* header() const { return reinterpret_cast<shm::SegHeader*>(base); }
  shm::RankCtl* rank_ctl(size_t local) const {
    return reinterpret_cast<shm::RankCtl*>(base + layout.ranks_offset()) + local;
  }
  uint8_t* fifo(size_t from, size_t to) const { return base + layout.fifo_offset(from, to); }
  int local_of(int group_rank) const;
  void probe_single_copy(Store& store, core::Deadline deadline);
};

}  // namespace cohort::transport
