// Single-copy allgather (every peer on this host, and the kernel lets ranks
// access each other's memory: ShmTransport::single_copy).
//
// Every rank contributes one block of bytes_per_rank; every rank's output is
// the n blocks in rank order. Ranks swap the addresses of their input and
// output buffers (one small message each way), then each byte crosses once,
// in one of two ways that every rank picks alike (all see the same list):
//
//   - Push, when every rank's output is a shared buffer and the outputs
//     reach COHORT_ALLGATHER_PUSH_BYTES: rank r reads its own block once,
//     piece by piece, and writes each piece into block r of every output,
//     its own and its peers' (mapped; process_vm_writev where a mapping
//     fails). Its input stays in its own cache, read once; the lines it
//     writes into a peer's output are pulled into its cache for writing.
//     From core::stream_copy_min() of output up (too large to stay in any
//     cache) it writes with non-temporal stores (core/stream_copy.hpp)
//     since this rank does not read those bytes again: per rank, for a
//     2-rank 64 MiB allgather, 32 MiB read and 64 MiB written, where pulling
//     with memcpy reads and writes about twice that (two reads, and every
//     destination line read for ownership before it is written).
//     Measured on the Intel VM (2 ranks, busbw, docs/algorithms.md): at 1 MiB
//     pushing with memcpy 17 GB/s against 10-12 pulling; at 16 MiB 8.7
//     (memcpy) against 7.4 (streaming) and 6.5 (pull); at 64 MiB 7.2
//     (streaming) against 4.3 (memcpy) and 3.7 (pull).
//   - Pull, otherwise: rank r copies its own block into place and pulls each
//     peer q's block straight into block q of its output: a load from the
//     peer's shared buffer when it is one, else one process_vm_readv from the
//     peer's memory into the output.
//
// Last, the "done" word from every peer: after it every block has arrived and
// no peer reads this rank's input any more, so the call may return. A pushing
// rank fences its streaming stores before it sends the word.
//
// Why: the ring passes every block through n-1 hops of shm slots, two
// copies per hop, with every rank's thread taking part at every step; here
// each byte crosses once.
//
// Safety: pushing, rank q writes only block q of every output; pulling, only
// the other blocks of its own output. Inputs are only read. In place (the
// input is block r of rank r's output) nobody writes that block.
//
// The group runs it by default on shared buffers from
// COHORT_SINGLE_COPY_SHARED_BYTES of output, and on any buffers from
// COHORT_SINGLE_COPY_BYTES (through process_vm_readv 1.1-1.5x the ring's
// speed there on the Intel VM, even with it on the AMD one; docs/algorithms.md).
#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/algorithms.hpp"
#include "collectives/single_copy.hpp"
#include "core/env.hpp"
#include "core/stream_copy.hpp"

namespace cohort::collectives {

namespace {

const core::Knob kPushBytes{
    "COHORT_ALLGATHER_PUSH_BYTES", "512K",
    "single-copy allgathers whose output (in all) reaches this many bytes, into shared buffers on every rank, push "
    "each rank's block into every output instead of each rank pulling its peers' blocks; 0: never push",
    core::KnobKind::Bytes};

// Writes this rank's block into block `rank` of every output; false (nothing
// done) when some rank's output is not a shared buffer or the outputs are
// smaller than some rank's push threshold (`push_min`, the largest of them:
// each process reads its own knob). Every rank gives the same answer: all
// see the same lists and sizes. Whether the stores stream is this rank's own
// choice (its stream_copy_min): no peer needs to agree on that.
bool push_blocks(Comm& c, const uint8_t* send, uint8_t* recv, size_t bytes, const std::vector<PeerBuffer>& outs,
                 uint64_t push_min) {
  const int n = c.size(), rank = c.rank();
  const size_t at = bytes * static_cast<size_t>(rank), total = bytes * static_cast<size_t>(n);
  if (total < push_min || !all_shared(outs)) return false;
  const bool streaming = total >= core::stream_copy_min();
  std::vector<uint8_t*> dest(n, nullptr);  // nullptr: process_vm_writev
  for (int q = 0; q < n; ++q) dest[q] = q == rank ? recv : map_shared(c, q, outs[q].ref, outs[q].addr, total);
  // Piece by piece, so that the second and later destinations read the piece from cache.
  for (size_t p = 0; p < bytes; p += kSingleCopyPiece) {
    const size_t m = std::min(kSingleCopyPiece, bytes - p);
    for (int k = 0; k < n; ++k) {
      const int q = (rank + k) % n;  // everyone starts with its own output, then a different peer
      if (q == rank && recv + at == send) continue;  // in place
      if (!dest[q]) {
        if (p == 0) c.write_peer(q, outs[q].addr + at, send, bytes);  // the whole block in one call
      } else if (streaming) {
        core::stream_copy(dest[q] + at + p, send + p, m);
      } else {
        std::memcpy(dest[q] + at + p, send + p, m);
      }
    }
  }
  if (streaming) core::stream_fence();  // the stores land before the "done" word does
  return true;
}

}  // namespace

size_t allgather_push_min() {
  static const size_t v = [] {
    const uint64_t b = kPushBytes.bytes();
    return b == 0 ? SIZE_MAX : static_cast<size_t>(b);
  }();
  return v;
}

bool allgather_single_copy(Comm& c, const uint8_t* send, uint8_t* recv, size_t bytes_per_rank, bool shared_only) {
  const int n = c.size(), rank = c.rank();
  if (bytes_per_rank == 0) return true;  // the same on every rank (the group checked the counts)
  uint8_t* mine = recv + bytes_per_rank * static_cast<size_t>(rank);
  if (n == 1) {
    if (mine != send) std::memcpy(mine, send, bytes_per_rank);
    return true;
  }
  // One exchange for both buffers' addresses and each rank's size to push from.
  struct Mine {
    PeerBuffer in, out;
    uint64_t push_min;
  };
  const size_t total = bytes_per_rank * static_cast<size_t>(n);
  const Mine mine_{{reinterpret_cast<uint64_t>(send), transport::find_shared_buffer(send, bytes_per_rank)},
                   {reinterpret_cast<uint64_t>(recv), transport::find_shared_buffer(recv, total)},
                   allgather_push_min()};
  std::vector<Mine> all(static_cast<size_t>(n));
  allgather_direct(c, reinterpret_cast<const uint8_t*>(&mine_), reinterpret_cast<uint8_t*>(all.data()), sizeof mine_);
  std::vector<PeerBuffer> ins, outs;
  uint64_t push_min = 0;
  for (const Mine& m : all) ins.push_back(m.in), outs.push_back(m.out), push_min = std::max(push_min, m.push_min);
  if (!push_blocks(c, send, recv, bytes_per_rank, outs, push_min)) {
    if (shared_only && !all_shared(ins)) return false;  // every rank sees the same addresses: all agree
    if (mine != send) std::memcpy(mine, send, bytes_per_rank);
    for (int k = 1; k < n; ++k) {
      const int q = (rank + k) % n;  // everyone starts at a different peer
      uint8_t* to = recv + bytes_per_rank * static_cast<size_t>(q);
      if (const uint8_t* from = map_shared(c, q, ins[q].ref, ins[q].addr, bytes_per_rank))
        std::memcpy(to, from, bytes_per_rank);
      else
        c.read_peer(q, ins[q].addr, to, bytes_per_rank);
    }
  }
  single_copy_done(c);  // "your block has arrived, and I am done with your input"
  return true;
}

}  // namespace cohort::collectives
