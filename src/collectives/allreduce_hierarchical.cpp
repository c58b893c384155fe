// Node-aware allreduce (algorithms.hpp), for groups spread over several
// hosts with the same number L of ranks on each:
//
//   1. reduce-scatter among the L ranks of each host (over shared memory):
//      each local rank ends with one chunk reduced over its host;
//   2. allreduce of that chunk among the H ranks that own it, one per host
//      (over the network): it is now reduced over every rank;
//   3. allgather among the ranks of each host.
//
// Per rank, step 2 sends 2 (H-1)/H of count/L elements across hosts; all L
// ranks of a host do so at once, so a host sends 2 (H-1)/H of the buffer in
// all. A flat ring over the same ranks crosses between hosts on H of its
// edges and sends 2 (n-1)/n of the buffer over each: for 2 hosts of 2 ranks,
// 1.5 buffers each way against the 1 buffer here. (Horovod's hierarchical
// allreduce and NCCL's intra-node rings and inter-node trees have this shape.)
//
// Steps 1 and 3 on the host take one of two forms:
//   - the ring's two halves through the shm slots (any buffers): each byte
//     is copied into a slot and out of it, and rank l owns chunk (l + 1) % L;
//   - single copy, when the host's links allow it (ShmTransport::single_copy)
//     and every local rank's send and receive buffers are shared buffers
//     (ProcessGroup::allocate_buffer: DDP's buckets, `cohort bench
//     --shared-buffers`). The local ranks swap their buffers' addresses and
//     map the peers' buffers once; rank l owns the same chunk as in the ring
//     (hosts may take different forms: the ranks of one local index must
//     reduce the same chunk across hosts). It reduces that chunk of every
//     local send buffer straight into its own receive buffer, runs step 2 on
//     it, then stores the finished chunk straight into every local peer's
//     receive buffer. No byte passes through a slot: per rank the host
//     phases read and write about 5/2 of its chunk's bytes per local rank
//     where the ring's halves move 9/2 (L = 2), and they need the peers'
//     threads only for the address swap and the final "done" word.
//     Ordinary buffers keep the ring: process_vm_readv pins their pages on
//     every call, which measured slower than the slots on 2 cores
//     (reduce_scatter_single_copy.cpp).
//
// Safety of the single-copy form: rank l reads only its chunk c of its peers'
// send buffers and writes only chunk c of their receive buffers, and only
// after it has read every send chunk c (its own step 1 comes first). In place
// (send == recv) a peer q's chunk c is thus read by l before l writes it, and
// q itself touches only its own chunk. A buffer is left alone by the peers once
// its owner has every peer's "done" word.
#include <algorithm>
#include <vector>

#include "collectives/algorithms.hpp"
#include "collectives/single_copy.hpp"
#include "core/reduce.hpp"

namespace cohort::collectives {

namespace {

void cross_allreduce(Comm& cross, uint8_t* chunk, size_t len, DType t, ReduceOp op, int avg_div, size_t cross_rd_max) {
  if (len * dtype_size(t) <= cross_rd_max) {
    allreduce_recursive_doubling(cross, chunk, chunk, len, t, op);
    if (avg_div > 0) core::scale_avg(chunk, len, t, avg_div);
  } else {
    allreduce_ring(cross, chunk, chunk, len, t, op, avg_div);
  }
}

// The single-copy form (above). False, having moved no data, when some local
// rank's buffers are not shared buffers: every local rank sees the same
// swapped references, so all of them agree.
bool hierarchical_single_copy(Comm& local, Comm& cross, const uint8_t* send, uint8_t* recv, size_t count, DType t,
                              ReduceOp op, int avg_div, size_t cross_rd_max) {
  const int n = local.size();
  const size_t es = dtype_size(t), bytes = count * es;
  const SendRecvBuffers theirs = swap_send_recv(local, send, recv, bytes);
  if (!all_shared(theirs.send) || !all_shared(theirs.recv)) return false;
  const std::vector<uint8_t*> peer_send = map_peers(local, theirs.send, bytes),
                              peer_recv = map_peers(local, theirs.recv, bytes);
  const int owned = ring_owned_chunk(local.rank(), n);
  const size_t off = chunk_off(count, n, owned) * es, len = chunk_len(count, n, owned) * es;

  // 1. This rank's chunk of every local send buffer, reduced into this rank's receive buffer (cache-sized pieces).
  const size_t piece_max = kSingleCopyPiece / es * es;
  uint8_t* scratch = local.scratch(piece_max);
  for (size_t p = 0; p < len; p += piece_max)
    reduce_piece(local, recv + off + p, send + off + p, peer_send, theirs.send, off + p, std::min(piece_max, len - p),
                 scratch, t, op);
  // 2. Across hosts.
  cross_allreduce(cross, recv + off, len / es, t, op, avg_div, cross_rd_max);
  // 3. The finished chunk into every local peer's receive buffer.
  for (int k = 1; k < n; ++k) store_to_peer(local, (local.rank() + k) % n, peer_recv, theirs.recv, off, recv + off, len);
  single_copy_done(local);  // "your chunk of mine is delivered, and I am done with your send buffer"
  return true;
}

}  // namespace

bool allreduce_hierarchical(Comm& local, Comm& cross, const uint8_t* send, uint8_t* recv, size_t count, DType t,
                            ReduceOp op, int avg_div, size_t cross_rd_max, bool try_single_copy) {
  if (try_single_copy && local.size() > 1 &&
      hierarchical_single_copy(local, cross, send, recv, count, t, op, avg_div, cross_rd_max))
    return true;
  const size_t es = dtype_size(t);
  ring_reduce_scatter_phase(local, send, recv, count, t, op, 0);
  const int owned = ring_owned_chunk(local.rank(), local.size());
  uint8_t* chunk = recv + chunk_off(count, local.size(), owned) * es;
  cross_allreduce(cross, chunk, chunk_len(count, local.size(), owned), t, op, avg_div, cross_rd_max);
  ring_allgather_phase(local, recv, count, t);
  return false;
}

}  // namespace cohort::collectives
