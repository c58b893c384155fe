// Single-copy allreduce (large messages, every peer on this host, and the
// kernel lets ranks access each other's memory: ShmTransport::single_copy).
//
// The buffer is cut into n blocks, one per rank, as in the ring. Ranks first
// swap the addresses of their send and receive buffers (one small message
// each way). Then rank r, alone, for each piece of its block r:
//   - reads the piece of every peer's send buffer (process_vm_readv) into a
//     cache-sized scratch and reduces it into its own receive buffer;
//   - for Avg divides the piece;
//   - writes the finished piece into every peer's receive buffer
//     (process_vm_writev), while it is still in cache.
// Last, each rank tells every peer "your block is delivered" and waits for
// the same word from every peer: then its receive buffer is complete, and no
// peer reads its send buffer any more, so the call may return. Both exchanges
// (addresses, final word) are allgather_direct calls.
//
// Why: the ring through shm slots copies every byte twice (into a slot, out of
// it) and hands a slot to the neighbour every 128 KiB, so both ranks' threads
// must run at the same time throughout. Here each byte crosses once, and a
// rank does its whole share without waiting for its peers' threads (only
// their first message and the final word), which is what counts when the
// progress thread shares a core with training (DDP on 2 cores). Per rank with
// 2 ranks: 80% of the buffer's bytes of memory traffic, against ~180%.
//
// Shared buffers (ProcessGroup::allocate_buffer, transport/shared_buffer.hpp):
// with the addresses each rank also sends the SharedRef of its buffers. Where
// a peer's buffer is one, this rank maps it once (cached by the connection)
// and reduces straight from the peer's memory and stores the result straight
// into it: no kernel copy, no scratch, no page pinning per call. Per rank with
// 2 ranks that is ~80 MB of memory traffic for a 40 MB buffer instead of
// ~140 MB. Each rank decides this per peer on its own; the peers cannot tell.
// The stores reach the peer before the final word does: the word goes through
// the shm FIFO with release/acquire ordering, like every message.
//
// Gathered input (ProcessGroup::allreduce_gathered, in place): DDP may leave a
// gradient where autograd put it instead of copying it into its bucket. The
// parts that fall in a peer's block are copied into the buffer before the
// address swap (the swap is what lets the peer read it); the parts in this
// rank's own block are read where they are during the reduction, which writes
// the buffer's block anyway. That saves copying a 1/n of the bucket per rank.
//
// Safety of the accesses: rank q writes only block q of the other ranks'
// receive buffers, and reads only block q of their send buffers; rank r
// itself writes only block r of its receive buffer until the end. In place
// (send == recv), block q of rank r's buffer is read by q before q writes
// it, and r does not touch block q. A buffer stays untouched by peers once
// its owner has the final words.
#include "collectives/algorithms.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/single_copy.hpp"
#include "core/check.hpp"
#include "core/reduce.hpp"

namespace cohort::collectives {

namespace {
// A stretch of this rank's own block (byte offsets in the buffer) and where its
// input is: a piece's memory, or the buffer itself (src == nullptr).
struct OwnSpan {
  size_t at, len;
  const uint8_t* src;
};

// Copies into `buf` the parts of the pieces outside [lo, hi) (bytes), and
// returns the own block [lo, hi) cut where pieces begin and end.
std::vector<OwnSpan> place_pieces(uint8_t* buf, std::span<const InputPiece> pieces, size_t es, size_t lo, size_t hi) {
  std::vector<OwnSpan> own;
  size_t at = lo;  // own block covered up to here
  for (const InputPiece& p : pieces) {
    const size_t a = p.offset * es, b = a + p.count * es;
    const auto* src = static_cast<const uint8_t*>(p.data);
    if (a == b || src == buf + a) continue;
    if (a < lo) std::memcpy(buf + a, src, std::min(b, lo) - a);
    if (b > hi) std::memcpy(buf + std::max(a, hi), src + (std::max(a, hi) - a), b - std::max(a, hi));
    const size_t ia = std::max(a, lo), ib = std::min(b, hi);
    if (ia >= ib) continue;
    if (ia > at) own.push_back({at, ia - at, nullptr});
    own.push_back({ia, ib - ia, src + (ia - a)});
    at = ib;
  }
  if (hi > at) own.push_back({at, hi - at, nullptr});
  return own;
}
}  // namespace

bool allreduce_single_copy(Comm& c, const uint8_t* send, uint8_t* recv, size_t count, DType t, ReduceOp op, int avg_div,
                           bool shared_only, std::span<const InputPiece> pieces) {
  const int n = c.size(), rank = c.rank();
  const size_t es = dtype_size(t);
  COHORT_ASSERT(pieces.empty() || send == recv, "allreduce_single_copy: pieces with separate send and recv buffers");
  const size_t off = chunk_off(count, n, rank) * es, len = chunk_len(count, n, rank) * es;
  if (n == 1) {
    if (send != recv) std::memcpy(recv, send, count * es);
    place_pieces(recv, pieces, es, 0, 0);
    return true;
  }
  // Peers read the rest of this buffer after the address swap: place it now.
  const std::vector<OwnSpan> own = place_pieces(recv, pieces, es, off, off + len);
  const size_t bytes = count * es;
  const SendRecvBuffers theirs = swap_send_recv(c, send, recv, bytes);
  if (shared_only && (!all_shared(theirs.send) || !all_shared(theirs.recv))) {  // the same answer on every rank
    for (const OwnSpan& s : own)
      if (s.src) std::memcpy(recv + s.at, s.src, s.len);
    return false;
  }

  // Peers' buffers this rank can load from and store to directly (nullptr: process_vm_readv/writev).
  const std::vector<uint8_t*> peer_send = map_peers(c, theirs.send, bytes), peer_recv = map_peers(c, theirs.recv, bytes);

  const size_t piece_max = kSingleCopyPiece / es * es;
  uint8_t* scratch = c.scratch(piece_max);
  for (const OwnSpan& span : own) {
    for (size_t p = 0; p < span.len; p += piece_max) {
      const size_t m = std::min(piece_max, span.len - p), at = span.at + p;
      reduce_piece(c, recv + at, span.src ? span.src + p : send + at, peer_send, theirs.send, at, m, scratch, t, op);
      if (avg_div > 1) core::scale_avg(recv + at, m / es, t, avg_div);
      for (int k = 1; k < n; ++k) store_to_peer(c, (rank + k) % n, peer_recv, theirs.recv, at, recv + at, m);
    }
  }

  // "Your block is delivered, and I am done with your send buffer."
  single_copy_done(c);
  return true;
}

}  // namespace cohort::collectives
