// Node-aware allgather, reduce_scatter and broadcast (algorithms.hpp): each
// moves a block across hosts only among the ranks of one local index, as
// allreduce_hierarchical does. The blocks of a host's ranks are not
// contiguous in the group's rank order in general (ranks may be interleaved
// over hosts), so the first two work on bundles ordered (local index, host)
// and copy between those and rank order on this host.
#include <cstring>

#include "collectives/algorithms.hpp"

namespace cohort::collectives {

void allgather_hierarchical(Comm& local, Comm& cross, const Members& members, const uint8_t* send, uint8_t* recv,
                            size_t bytes_per_rank) {
  const size_t b = bytes_per_rank;
  const int hosts = cross.size(), per_host = local.size();
  // 1. Across hosts: the blocks of the ranks with this local index, in host order.
  uint8_t* bundle = cross.scratch(hosts * b, 1);
  allgather_ring(cross, send, bundle, b);
  // 2. On the host: every local index's bundle, ordered (local index, host).
  uint8_t* all = local.scratch(static_cast<size_t>(per_host) * hosts * b, 1);
  allgather_ring(local, bundle, all, hosts * b);
  for (int j = 0; j < per_host; ++j)
    for (int h = 0; h < hosts; ++h)
      std::memcpy(recv + static_cast<size_t>(members[h][j]) * b, all + (static_cast<size_t>(j) * hosts + h) * b, b);
}

void reduce_scatter_hierarchical(Comm& local, Comm& cross, const Members& members, const uint8_t* send, uint8_t* recv,
                                 size_t count_per_rank, DType t, ReduceOp op, int avg_div) {
  const size_t b = count_per_rank * dtype_size(t);
  const int hosts = cross.size(), per_host = local.size();
  // 1. Input reordered (local index, host), so that local index j's bundle holds the blocks of the ranks with
  //    local index j on every host; reduced over this host's ranks, each keeps its own bundle.
  uint8_t* packed = local.scratch(static_cast<size_t>(per_host) * hosts * b, 1);
  for (int j = 0; j < per_host; ++j)
    for (int h = 0; h < hosts; ++h)
      std::memcpy(packed + (static_cast<size_t>(j) * hosts + h) * b, send + static_cast<size_t>(members[h][j]) * b, b);
  uint8_t* bundle = cross.scratch(hosts * b, 1);
  reduce_scatter_ring(local, packed, bundle, hosts * count_per_rank, t, op, 0);
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
