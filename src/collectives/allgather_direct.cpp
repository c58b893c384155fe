// Direct allgather (latency-optimal for small blocks and few ranks).
//
// Every rank sends its block to every other rank and receives theirs, all in
// one round: one message latency instead of n - 1, at the cost of n - 1
// concurrent messages per rank.
#include "collectives/algorithms.hpp"

#include <cstring>
#include <vector>

namespace cohort::collectives {

void allgather_direct(Comm& c, const uint8_t* send, uint8_t* recv, size_t bytes_per_rank) {
  const int n = c.size(), rank = c.rank();
  if (send != recv + rank * bytes_per_rank) std::memcpy(recv + rank * bytes_per_rank, send, bytes_per_rank);
  std::vector<transport::SendOp> sends;
  std::vector<transport::RecvOp> recvs;
  for (int p = 0; p < n; ++p) {
    if (p == rank) continue;
    sends.push_back({c.conn(p), send, bytes_per_rank});
    recvs.push_back({c.conn(p), bytes_per_rank, {}, Sink::copy_to(recv + p * bytes_per_rank)});
  }
  c.run(sends, recvs);
}

}  // namespace cohort::collectives
