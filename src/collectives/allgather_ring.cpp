// Ring allgather (bandwidth-optimal).
//
// Every rank first places its own block at recv[rank]. In step s = 0 .. n-2 it
// sends block (rank - s) to its right neighbour and receives block
// (rank - s - 1) from its left one, so each block travels once around the ring.
// Each rank sends and receives (n-1)/n of the output: the busbw factor.
#include "collectives/algorithms.hpp"

#include <cstring>
#include <vector>

namespace cohort::collectives {

void allgather_ring_blocks(Comm& c, uint8_t* recv, std::span<const size_t> offsets, size_t bytes_per_rank) {
  const int n = c.size(), rank = c.rank();
  const int right = (rank + 1) % n, left = (rank - 1 + n) % n;
  for (int s = 0; s < n - 1; ++s) {
    int sb = ((rank - s) % n + n) % n, rb = ((rank - s - 1) % n + n) % n;
    c.sendrecv(right, recv + offsets[sb], bytes_per_rank, left, Sink::copy_to(recv + offsets[rb]), bytes_per_rank);
  }
}

void allgather_ring(Comm& c, const uint8_t* send, uint8_t* recv, size_t bytes_per_rank) {
  const int n = c.size(), rank = c.rank();
  if (send != recv + rank * bytes_per_rank) std::memcpy(recv + rank * bytes_per_rank, send, bytes_per_rank);
  std::vector<size_t> offsets(n);
  for (int r = 0; r < n; ++r) offsets[r] = r * bytes_per_rank;
  allgather_ring_blocks(c, recv, offsets, bytes_per_rank);
}

}  // namespace cohort::collectives
