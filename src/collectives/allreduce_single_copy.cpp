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

#include "core/reduce.hpp"

namespace cohort::collectives {

namespace {
constexpr size_t kPiece = 256 * 1024;  // fits L2 with the destination piece
}

void allreduce_single_copy(Comm& c, const uint8_t* send, uint8_t* recv, size_t count, DType t, ReduceOp op,
                           int avg_div) {
  const int n = c.size(), rank = c.rank();
  const size_t es = dtype_size(t);
  if (n == 1) {
    if (send != recv) std::memcpy(recv, send, count * es);
    return;
  }
  struct Addrs {
    uint64_t send, recv;
  };
  const Addrs mine{reinterpret_cast<uint64_t>(send), reinterpret_cast<uint64_t>(recv)};
  std::vector<Addrs> theirs(n);
  allgather_direct(c, reinterpret_cast<const uint8_t*>(&mine), reinterpret_cast<uint8_t*>(theirs.data()), sizeof mine);

  const size_t off = chunk_off(count, n, rank) * es, len = chunk_len(count, n, rank) * es;
  const size_t piece_max = kPiece / es * es;
  uint8_t* scratch = c.scratch(piece_max);
  for (size_t p = 0; p < len; p += piece_max) {
    const size_t m = std::min(piece_max, len - p), at = off + p;
    for (int k = 1; k < n; ++k) {
      const int q = (rank + k) % n;
      c.read_peer(q, theirs[q].send + at, scratch, m);
      core::reduce(recv + at, (k == 1 ? send : recv) + at, scratch, m / es, t, op);
    }
    if (avg_div > 1) core::scale_avg(recv + at, m / es, t, avg_div);
    for (int k = 1; k < n; ++k) {
      const int q = (rank + k) % n;
      c.write_peer(q, theirs[q].recv + at, recv + at, m);
    }
  }

  // "Your block is delivered, and I am done with your send buffer."
  const uint8_t done = 1;
  std::vector<uint8_t> got(n);
  allgather_direct(c, &done, got.data(), 1);
}

}  // namespace cohort::collectives
