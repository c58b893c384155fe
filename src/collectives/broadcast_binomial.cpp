// Binomial-tree broadcast (latency-optimal: ceil(log2 n) rounds).
//
// Ranks are renumbered relative to the root: v = (rank - root) mod n. In round
// k (mask = 2^k) every v < mask that has the data sends it to v + mask. A rank
// first receives from v - (highest bit of v), then sends to v + 2^j for every
// 2^j below that bit, largest first.
#include "collectives/algorithms.hpp"

namespace cohort::collectives {

void broadcast_binomial(Comm& c, uint8_t* buf, size_t bytes, int root) {
  const int n = c.size();
  const int v = (c.rank() - root + n) % n;
  auto real = [&](int vr) { return (vr + root) % n; };
  int mask = 1;
  while (mask < n) {
    if (v & mask) {
      c.recv(real(v - mask), buf, bytes);
      break;
    }
    mask <<= 1;
  }
  mask >>= 1;
  while (mask > 0) {
    if (v + mask < n) c.send(real(v + mask), buf, bytes);
    mask >>= 1;
  }
}

}  // namespace cohort::collectives
