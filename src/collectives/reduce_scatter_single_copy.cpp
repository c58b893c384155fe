// Single-copy reduce_scatter (every peer on this host, and the kernel lets
// ranks access each other's memory: ShmTransport::single_copy).
//
// The input of every rank is n blocks of count_per_rank elements; rank r's
// output is the reduction of block r over all ranks. Ranks swap the
// addresses of their input buffers (one small message each way). Then rank
// r, alone, for each cache-sized piece of block r: reduces its own piece
// with every peer's (loaded straight from a peer's shared buffer, else read
// with process_vm_readv into a scratch piece) into its output, and for Avg
// divides it while it is in cache. Last, the "done" word from every peer:
// after it no peer reads this rank's input any more, so the call may return.
//
// Why: the ring moves (n-1)/n of the input through shm slots twice per
// byte and needs every rank's thread at every step; here each byte of a
// peer's block crosses once, and a rank needs its peers' threads only for
// the two small exchanges. (The first half of allreduce_single_copy.cpp,
// without writing the result back out.)
//
// In place (output = block r of the input): peers read only blocks q != r of
// this rank's input, and this rank writes only block r.
//
// Ordinary memory goes through process_vm_readv, which pins the pages on
// every call: on the 2-core VM that measured slower than the ring (docs/
// algorithms.md), so the group runs it there only when COHORT_ALGO asks;
// with shared buffers (mapped once) it is 2-4x the ring's speed.
#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/algorithms.hpp"
#include "collectives/single_copy.hpp"
#include "core/reduce.hpp"

namespace cohort::collectives {

bool reduce_scatter_single_copy(Comm& c, const uint8_t* send, uint8_t* recv, size_t count_per_rank, DType t,
                                ReduceOp op, int avg_div, bool shared_only) {
  const int n = c.size(), rank = c.rank();
  const size_t es = dtype_size(t), block = count_per_rank * es, total = block * static_cast<size_t>(n);
  const size_t own = block * static_cast<size_t>(rank);  // where this rank's block starts in every input
  if (block == 0) return true;  // the same on every rank (the group checked the counts)
  if (n == 1) {
    if (recv != send) std::memcpy(recv, send, block);
    if (avg_div > 1) core::scale_avg(recv, count_per_rank, t, avg_div);
    return true;
  }
  const std::vector<PeerBuffer> theirs = swap_buffers(c, send, total);
  if (shared_only && !all_shared(theirs)) return false;  // every rank sees the same addresses: all agree
  const std::vector<uint8_t*> peer_send = map_peers(c, theirs, total);

  const size_t piece_max = kSingleCopyPiece / es * es;
  uint8_t* scratch = c.scratch(piece_max);
  for (size_t p = 0; p < block; p += piece_max) {
    const size_t m = std::min(piece_max, block - p), at = own + p;
    reduce_piece(c, recv + p, send + at, peer_send, theirs, at, m, scratch, t, op);
    if (avg_div > 1) core::scale_avg(recv + p, m / es, t, avg_div);
  }
  single_copy_done(c);  // "I am done with your input"
  return true;
}

}  // namespace cohort::collectives
