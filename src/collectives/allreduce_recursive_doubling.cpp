// Recursive-doubling allreduce (latency-optimal for small messages).
//
// Let p be the largest power of two <= n and extra = n - p. First the extra
// ranks p .. n-1 fold in: rank p + i sends its vector to rank i, which reduces
// it. Then ranks 0 .. p-1 run log2(p) rounds: in round k, rank r exchanges its
// whole vector with partner r XOR 2^k and both reduce. Last, rank i sends the
// result back to rank p + i. Every rank sends whole vectors, so this wins only
// while latency dominates (see docs/algorithms.md for the threshold).
//
// Both partners reduce "mine (op) theirs" with commutative ops, so every rank
// ends with bit-identical results.
#include "collectives/algorithms.hpp"

#include <cstring>

namespace cohort::collectives {

void allreduce_recursive_doubling(Comm& c, const uint8_t* send, uint8_t* recv, size_t count, DType t, ReduceOp op) {
  const int n = c.size(), rank = c.rank();
  const size_t bytes = count * dtype_size(t);
  if (send != recv) std::memcpy(recv, send, bytes);
  if (n == 1) return;
  int p = 1;
  while (p * 2 <= n) p *= 2;
  const int extra = n - p;

  if (rank >= p) {
    c.send(rank - p, recv, bytes);
    c.recv(rank - p, recv, bytes);
    return;
  }
  if (rank < extra) c.recv_reduce(rank + p, recv, recv, bytes, t, op);

  // We send our current vector while receiving the partner's: send from a copy.
  uint8_t* mine = c.scratch(bytes);
  for (int mask = 1; mask < p; mask <<= 1) {
    const int partner = rank ^ mask;
    std::memcpy(mine, recv, bytes);
    c.sendrecv(partner, mine, bytes, partner, Sink::reduce_into(recv, mine, t, op), bytes);
  }
  if (rank < extra) c.send(rank + p, recv, bytes);
}

}  // namespace cohort::collectives
