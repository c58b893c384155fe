// Single-copy allgather (every peer on this host, and the kernel lets ranks
// access each other's memory: ShmTransport::single_copy).
//
// Every rank contributes one block of bytes_per_rank; every rank's output is
// the n blocks in rank order. Ranks swap the addresses of their input blocks
// (one small message each way). Then rank r copies its own block into place
// and pulls each peer q's block straight into block q of its output: a load
// from the peer's shared buffer when it is one, else one process_vm_readv
// from the peer's memory into the output (no scratch, no second copy). Last,
// the "done" word from every peer: after it no peer reads this rank's block
// any more, so the call may return.
//
// Why: the ring passes every block through n-1 hops of shm slots, two
// copies per hop, with every rank's thread taking part at every step; here
// each byte crosses once, pulled by the rank that needs it.
//
// In place (input = block r of the output): peers read only block r of this
// rank's output, and this rank writes only the blocks q != r.
//
// Like reduce_scatter_single_copy, the group runs it by default only on
// shared buffers (faster than the ring there; about even with it through
// process_vm_readv on the 2-core VM).
#include <cstring>
#include <vector>

#include "collectives/algorithms.hpp"
#include "collectives/single_copy.hpp"

namespace cohort::collectives {

bool allgather_single_copy(Comm& c, const uint8_t* send, uint8_t* recv, size_t bytes_per_rank, bool shared_only) {
  const int n = c.size(), rank = c.rank();
  if (bytes_per_rank == 0) return true;  // the same on every rank (the group checked the counts)
  uint8_t* mine = recv + bytes_per_rank * static_cast<size_t>(rank);
  if (n == 1) {
    if (mine != send) std::memcpy(mine, send, bytes_per_rank);
    return true;
  }
  const std::vector<PeerBuffer> theirs = swap_buffers(c, send, bytes_per_rank);
  if (shared_only && !all_shared(theirs)) return false;  // every rank sees the same addresses: all agree
  if (mine != send) std::memcpy(mine, send, bytes_per_rank);
  for (int k = 1; k < n; ++k) {
    const int q = (rank + k) % n;  // everyone starts at a different peer
    uint8_t* to = recv + bytes_per_rank * static_cast<size_t>(q);
    if (const uint8_t* from = map_shared(c, q, theirs[q].ref, theirs[q].addr, bytes_per_rank))
      std::memcpy(to, from, bytes_per_rank);
    else
      c.read_peer(q, theirs[q].addr, to, bytes_per_rank);
  }
  single_copy_done(c);  // "I am done with your block"
  return true;
}

}  // namespace cohort::collectives
