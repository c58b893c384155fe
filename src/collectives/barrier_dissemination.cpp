// Dissemination barrier: ceil(log2 n) rounds; in round k every rank sends an
// empty message to rank + 2^k and waits for one from rank - 2^k. After the last
// round every rank has (transitively) heard from every other rank.
#include "collectives/algorithms.hpp"

namespace cohort::collectives {

void barrier_dissemination(Comm& c) {
  const int n = c.size(), rank = c.rank();
  for (int k = 1; k < n; k <<= 1) {
    c.sendrecv((rank + k) % n, nullptr, 0, (rank - k + n) % n, Sink::copy_to(nullptr), 0);
  }
}

}  // namespace cohort::collectives
