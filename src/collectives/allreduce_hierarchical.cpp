// Node-aware allreduce (algorithms.hpp), for groups spread over several
// hosts with the same number L of ranks on each:
//
//   1. reduce-scatter among the L ranks of each host (the ring's first half,
//      over shared memory): rank l of a host ends with chunk (l + 1) % L
//      reduced over its host;
//   2. allreduce of that chunk among the H ranks that own it, one per host
//      (over the network): it is now reduced over every rank;
//   3. allgather among the ranks of each host (the ring's second half).
//
// Per rank, step 2 sends 2 (H-1)/H of count/L elements across hosts; all L
// ranks of a host do so at once, so a host sends 2 (H-1)/H of the buffer in
// all. A flat ring over the same ranks crosses between hosts on H of its
// edges and sends 2 (n-1)/n of the buffer over each: for 2 hosts of 2 ranks,
// 1.5 buffers each way against the 1 buffer here. (Horovod's hierarchical
// allreduce and NCCL's intra-node rings and inter-node trees have this shape.)
#include "collectives/algorithms.hpp"
#include "core/reduce.hpp"

namespace cohort::collectives {

void allreduce_hierarchical(Comm& local, Comm& cross, const uint8_t* send, uint8_t* recv, size_t count, DType t,
                            ReduceOp op, int avg_div, size_t cross_rd_max) {
  const size_t es = dtype_size(t);
  ring_reduce_scatter_phase(local, send, recv, count, t, op, 0);
  const int owned = ring_owned_chunk(local.rank(), local.size());
  uint8_t* chunk = recv + chunk_off(count, local.size(), owned) * es;
  const size_t len = chunk_len(count, local.size(), owned);
  if (len * es <= cross_rd_max) {
    allreduce_recursive_doubling(cross, chunk, chunk, len, t, op);
    if (avg_div > 0) core::scale_avg(chunk, len, t, avg_div);
  } else {
    allreduce_ring(cross, chunk, chunk, len, t, op, avg_div);
  }
  ring_allgather_phase(local, recv, count, t);
}

}  // namespace cohort::collectives
