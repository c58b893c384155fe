// Ring allgather (bandwidth-optimal).
//
// Every rank first places its own block at recv[rank]. In step s = 0 .. n-2 it
// sends block (rank - s) to its right neighbour and receives block
// (rank - s - 1) from its left one, so each block travels once around the ring.
// Each rank sends and receives (n-1)/n of the output: the busbw factor.
#include "collectives/algorithms.hpp"

#include <cstring>

namespace cohort::collectives {

namespace {

// The ring over blocks whose byte offset in recv is at(r), this rank's own already in place.
template <class At>
void ring(Comm& c, uint8_t* recv, size_t bytes_per_rank, At at) {
  const int n = c.size(), rank = c.rank();
  const int right = (rank + 1) % n, left = (rank - 1 + n) % n;
  for (int s = 0; s < n - 1; ++s) {
    int sb = ((rank - s) % n + n) % n, rb = ((rank - s - 1) % n + n) % n;
    c.sendrecv(right, recv + at(sb), bytes_per_rank, left, Sink::copy_to(recv + at(rb)), bytes_per_rank);
  }
}

}  // namespace

void allgather_ring_blocks(Comm& c, uint8_t* recv, std::span<const size_t> offsets, size_t bytes_per_rank) {
  ring(c, recv, bytes_per_rank, [offsets](int r) { return offsets[r]; });
}

void allgather_ring(Comm& c, const uint8_t* send, uint8_t* recv, size_t bytes_per_rank) {
  const size_t b = bytes_per_rank;
  const int rank = c.rank();
  if (send != recv + rank * b) std::memcpy(recv + rank * b, send, b);
  ring(c, recv, b, [b](int r) { return r * b; });
}

}  // namespace cohort::collectives
