// Ring reduce-scatter (bandwidth-optimal).
//
// The input has n blocks; rank r ends with block r reduced over all ranks.
// In step s = 0 .. n-2 a rank sends block (rank - s - 1) to its right
// neighbour: its own input at step 0, afterwards the partial sum it built in
// the step before. It receives block (rank - s - 2) from its left neighbour and
// reduces it with its own input block. The last step receives block rank and
// reduces it straight into the output. Partial sums alternate between two
// scratch blocks so that the one being sent is never the one being written.
#include "collectives/algorithms.hpp"

#include <cstring>

namespace cohort::collectives {

namespace {

// The ring over input blocks whose byte offset in send is at(r).
template <class At>
void ring(Comm& c, const uint8_t* send, uint8_t* recv, size_t count_per_rank, DType t, ReduceOp op, int avg_div,
          At at) {
  const int n = c.size(), rank = c.rank();
  const size_t b = count_per_rank * dtype_size(t);
  if (n == 1) {
    if (send + at(0) != recv) std::memcpy(recv, send + at(0), b);
    return;
  }
  const int right = (rank + 1) % n, left = (rank - 1 + n) % n;
  auto mod = [n](int x) { return ((x % n) + n) % n; };
  uint8_t* acc[2] = {c.scratch(2 * b), nullptr};
  acc[1] = acc[0] + b;
  for (int s = 0; s < n - 1; ++s) {
    int sb = mod(rank - s - 1), rb = mod(rank - s - 2);
    const uint8_t* src = s == 0 ? send + at(sb) : acc[(s - 1) % 2];
    uint8_t* dst = s == n - 2 ? recv : acc[s % 2];
    c.sendrecv(right, src, b, left, Sink::reduce_into(dst, send + at(rb), t, op, s == n - 2 ? avg_div : 0), b);
  }
}

}  // namespace

void reduce_scatter_ring_blocks(Comm& c, const uint8_t* send, std::span<const size_t> offsets, uint8_t* recv,
                                size_t count_per_rank, DType t, ReduceOp op, int avg_div) {
  ring(c, send, recv, count_per_rank, t, op, avg_div, [offsets](int r) { return offsets[r]; });
}

void reduce_scatter_ring(Comm& c, const uint8_t* send, uint8_t* recv, size_t count_per_rank, DType t, ReduceOp op,
                         int avg_div) {
  const size_t b = count_per_rank * dtype_size(t);
  ring(c, send, recv, count_per_rank, t, op, avg_div, [b](int r) { return r * b; });
}

}  // namespace cohort::collectives
