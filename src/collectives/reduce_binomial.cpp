// Binomial-tree reduce towards the root (mirror image of broadcast_binomial).
//
// With v = (rank - root) mod n: in round k (mask = 2^k), a rank whose bit k is
// set sends its accumulated vector to v - mask and stops; otherwise it receives
// from v + mask (if that exists) and reduces into its accumulator. The root's
// accumulator is its output buffer; other ranks accumulate in scratch.
#include "collectives/algorithms.hpp"

#include <cstring>

namespace cohort::collectives {

void reduce_binomial(Comm& c, const uint8_t* send, uint8_t* recv, size_t count, DType t, ReduceOp op, int root) {
  const int n = c.size();
  const int v = (c.rank() - root + n) % n;
  const size_t bytes = count * dtype_size(t);
  auto real = [&](int vr) { return (vr + root) % n; };
  uint8_t* acc = (v == 0) ? recv : c.scratch(bytes);
  if (acc != send) std::memcpy(acc, send, bytes);
  for (int mask = 1; mask < n; mask <<= 1) {
    if (v & mask) {
      c.send(real(v - mask), acc, bytes);
      return;
    }
    if (v + mask < n) c.recv_reduce(real(v + mask), acc, acc, bytes, t, op);
  }
}

}  // namespace cohort::collectives
