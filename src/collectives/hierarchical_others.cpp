// Node-aware allgather, reduce_scatter and broadcast (algorithms.hpp): each
// moves a block across hosts only among the ranks of one local index, as
// allreduce_hierarchical does. The blocks of a host's ranks are not
// contiguous in the group's rank order in general (ranks may be interleaved
// over hosts), so the first two run their rings over blocks where they lie in
// rank order (allgather_ring_blocks, reduce_scatter_ring_blocks): no block is
// staged or reordered. Copying through bundles ordered (local index, host)
// instead cost a copy of the whole output per rank and made the allgather
// across 2 hosts x 2 ranks slower than the flat ring.
#include <cstring>
#include <vector>

#include "collectives/algorithms.hpp"

namespace cohort::collectives {

void allgather_hierarchical(Comm& local, Comm& cross, const Members& members, const uint8_t* send, uint8_t* recv,
                            size_t bytes_per_rank) {
  const size_t b = bytes_per_rank;
  const int hosts = cross.size(), per_host = local.size(), index = local.rank();
  const size_t mine = static_cast<size_t>(members[cross.rank()][index]) * b;
  if (send != recv + mine) std::memcpy(recv + mine, send, b);
  // 1. Across hosts: the blocks of the ranks with this local index.
  std::vector<size_t> at(hosts);
  for (int h = 0; h < hosts; ++h) at[h] = static_cast<size_t>(members[h][index]) * b;
  allgather_ring_blocks(cross, recv, at, b);
  // 2. On the host, for each host h: the blocks of h's ranks, local index j holding that of members[h][j].
  at.resize(per_host);
  for (int h = 0; h < hosts; ++h) {
    for (int j = 0; j < per_host; ++j) at[j] = static_cast<size_t>(members[h][j]) * b;
    allgather_ring_blocks(local, recv, at, b);
  }
}

void reduce_scatter_hierarchical(Comm& local, Comm& cross, const Members& members, const uint8_t* send, uint8_t* recv,
                                 size_t count_per_rank, DType t, ReduceOp op, int avg_div) {
  const size_t b = count_per_rank * dtype_size(t);
  const int hosts = cross.size(), per_host = local.size();
  // 1. On the host, for each host h: the blocks of h's ranks reduced over this host's ranks; local index j keeps
  //    that of members[h][j], as block h of its bundle.
  uint8_t* bundle = cross.scratch(hosts * b, 1);
  std::vector<size_t> at(per_host);
  for (int h = 0; h < hosts; ++h) {
    for (int j = 0; j < per_host; ++j) at[j] = static_cast<size_t>(members[h][j]) * b;
    reduce_scatter_ring_blocks(local, send, at, bundle + h * b, count_per_rank, t, op, 0);
  }
  // 2. Across hosts: host h's rank of this local index gets block h, reduced over every rank.
  reduce_scatter_ring(cross, bundle, recv, count_per_rank, t, op, avg_div);
}

void broadcast_hierarchical(Comm& local, Comm& cross, const Members& members, uint8_t* buf, size_t bytes, int root,
                            size_t binomial_max, size_t segment) {
  int root_host = 0, root_index = 0;
  for (int h = 0; h < static_cast<int>(members.size()); ++h)
    for (int j = 0; j < static_cast<int>(members[h].size()); ++j)
      if (members[h][j] == root) root_host = h, root_index = j;
  auto bcast = [&](Comm& c, int r) {
    if (c.size() < 2) return;
    if (c.size() <= 2 || bytes <= binomial_max) broadcast_binomial(c, buf, bytes, r);
    else broadcast_pipeline(c, buf, bytes, r, segment);
  };
  if (local.rank() == root_index) bcast(cross, root_host);  // the ranks of the root's local index
  bcast(local, root_index);
}

}  // namespace cohort::collectives
