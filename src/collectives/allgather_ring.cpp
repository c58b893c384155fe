// Ring allgather (bandwidth-optimal).
//
// Every rank first places its own block at recv[rank]. In step s = 0 .. n-2 it
// sends block (rank - s) to its right neighbour and receives block
// (rank - s - 1) from its left one, so each block travels once around the ring.
// Each rank sends and receives (n-1)/n of the output: the busbw factor.
#include "collectives/algorithms.hpp"

#include <cstring>

namespace cohort::collectives {

void allgather_ring(Comm& c, const uint8_t* send, uint8_t* recv, size_t bytes_per_rank) {
  const int n = c.size(), rank = c.rank();
  if (send != recv + rank * bytes_per_rank) std::memcpy(recv + rank * bytes_per_rank, send, bytes_per_rank);
  const int right = (rank + 1) % n, left = (rank - 1 + n) % n;
  for (int s = 0; s < n - 1; ++s) {
    int sb = ((rank - s) % n + n) % n, rb = ((rank - s - 1) % n + n) % n;
    c.sendrecv(right, recv + sb * bytes_per_rank, bytes_per_rank, left, Sink::copy_to(recv + rb * bytes_per_rank),
               bytes_per_rank);
  }
}

}  // namespace cohort::collectives
