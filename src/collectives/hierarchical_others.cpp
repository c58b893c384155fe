// Node-aware allgather, reduce_scatter and broadcast (algorithms.hpp): each
// moves a block across hosts only among the ranks of one local index, as
// allreduce_hierarchical does. The blocks of a host's ranks are not
// contiguous in the group's rank order in general (ranks may be interleaved
// over hosts), so the first two run their rings over blocks where they lie in
// rank order (allgather_ring_blocks, reduce_scatter_ring_blocks): no block is
// staged or reordered. Copying through bundles ordered (local index, host)
// instead cost a copy of the whole output per rank and made the allgather
// across 2 hosts x 2 ranks slower than the flat ring.
//
// With try_single_copy (the host's shm links allow it) and shared buffers on
// every local rank (the output for allgather, the input for reduce_scatter;
// the local ranks swap references and all see the same answer), the phase on
// the host loads and stores the peers' buffers directly, as in
// allreduce_hierarchical.cpp: allgather's local index j stores the blocks it
// holds after step 1 (those of members[h][j]) into every local peer's output,
// where nobody else writes them; reduce_scatter's local index j reduces the
// blocks of members[h][j] of every local peer's input straight into its
// bundle. Either form gives the same result, so hosts may differ.
#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/algorithms.hpp"
#include "collectives/single_copy.hpp"

namespace cohort::collectives {

namespace {

// The local ranks' buffers (one swap among them) and those of the peers
// mapped here (nullptr: this rank, or a peer whose mapping failed, reached
// with process_vm_readv/writev instead). shared: every local rank's buffer is
// a shared buffer (the same answer on every local rank).
struct LocalPeers {
  std::vector<PeerBuffer> bufs;
  std::vector<uint8_t*> mapped;
  bool shared = false;
};

LocalPeers map_local_peers(Comm& local, const void* p, size_t bytes) {
  LocalPeers out{swap_buffers(local, p, bytes), {}, false};
  out.shared = all_shared(out.bufs);
  if (!out.shared) return out;
  out.mapped = map_peers(local, out.bufs, bytes);
  return out;
}

}  // namespace

bool allgather_hierarchical(Comm& local, Comm& cross, const Members& members, const uint8_t* send, uint8_t* recv,
                            size_t bytes_per_rank, bool try_single_copy) {
  const size_t b = bytes_per_rank;
  const int hosts = cross.size(), per_host = local.size(), index = local.rank();
  const size_t mine = static_cast<size_t>(members[cross.rank()][index]) * b;
  if (send != recv + mine) std::memcpy(recv + mine, send, b);
  // 1. Across hosts: the blocks of the ranks with this local index.
  std::vector<size_t> at(hosts);
  for (int h = 0; h < hosts; ++h) at[h] = static_cast<size_t>(members[h][index]) * b;
  allgather_ring_blocks(cross, recv, at, b);
  // 2. On the host, for each host h: the blocks of h's ranks, local index j holding that of members[h][j].
  const size_t total = b * static_cast<size_t>(hosts * per_host);
  if (try_single_copy && per_host > 1 && b > 0) {
    const LocalPeers peers = map_local_peers(local, recv, total);
    if (peers.shared) {
      for (int q = 1; q < per_host; ++q) {
        const int p = (index + q) % per_host;
        for (int h = 0; h < hosts; ++h) {
          const size_t off = static_cast<size_t>(members[h][index]) * b;
          store_to_peer(local, p, peers.mapped, peers.bufs, off, recv + off, b);
        }
      }
      single_copy_done(local);  // "my blocks are in your output"
      return true;
    }
  }
  at.resize(per_host);
  for (int h = 0; h < hosts; ++h) {
    for (int j = 0; j < per_host; ++j) at[j] = static_cast<size_t>(members[h][j]) * b;
    allgather_ring_blocks(local, recv, at, b);
  }
  return false;
}

bool reduce_scatter_hierarchical(Comm& local, Comm& cross, const Members& members, const uint8_t* send, uint8_t* recv,
                                 size_t count_per_rank, DType t, ReduceOp op, int avg_div, bool try_single_copy) {
  const size_t es = dtype_size(t), b = count_per_rank * es;
  const int hosts = cross.size(), per_host = local.size(), index = local.rank();
  // 1. On the host, for each host h: the blocks of h's ranks reduced over this host's ranks; local index j keeps
  //    that of members[h][j], as block h of its bundle.
  uint8_t* bundle = cross.scratch(hosts * b, 1);
  bool single = false;
  if (try_single_copy && per_host > 1 && b > 0) {
    const LocalPeers peers = map_local_peers(local, send, b * static_cast<size_t>(hosts * per_host));
    single = peers.shared;
    if (single) {
      const size_t piece_max = kSingleCopyPiece / es * es;
      uint8_t* scratch = local.scratch(piece_max);
      for (int h = 0; h < hosts; ++h) {
        const size_t off = static_cast<size_t>(members[h][index]) * b;
        uint8_t* out = bundle + h * b;
        for (size_t p = 0; p < b; p += piece_max)
          reduce_piece(local, out + p, send + off + p, peers.mapped, peers.bufs, off + p, std::min(piece_max, b - p),
                       scratch, t, op);
      }
      single_copy_done(local);  // "I am done with your input"
    }
  }
  if (!single) {
    std::vector<size_t> at(per_host);
    for (int h = 0; h < hosts; ++h) {
      for (int j = 0; j < per_host; ++j) at[j] = static_cast<size_t>(members[h][j]) * b;
      reduce_scatter_ring_blocks(local, send, at, bundle + h * b, count_per_rank, t, op, 0);
    }
  }
  // 2. Across hosts: host h's rank of this local index gets block h, reduced over every rank.
  reduce_scatter_ring(cross, bundle, recv, count_per_rank, t, op, avg_div);
  return single;
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
