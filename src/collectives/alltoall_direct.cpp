// Direct all-to-all: block j of every rank's input goes to rank j. All n - 1
// sends and receives are in flight together; the engine progresses them as
// the transports allow, so no ordering between pairs can deadlock.
// send and recv must not overlap (the group layer copies the input first for
// in-place calls).
#include <cstring>
#include <vector>

#include "collectives/algorithms.hpp"

namespace cohort::collectives {

void alltoall_direct(Comm& c, const uint8_t* send, uint8_t* recv, size_t b) {
  const int n = c.size(), rank = c.rank();
  std::memcpy(recv + rank * b, send + rank * b, b);
  std::vector<transport::SendOp> sends;
  std::vector<transport::RecvOp> recvs;
  for (int k = 1; k < n; ++k) {
    // Stagger the partners (rank + k, rank - k) so that not everyone targets rank 0 first.
    int to = (rank + k) % n, from = (rank - k + n) % n;
    sends.push_back({c.conn(to), send + to * b, b});
    recvs.push_back({c.conn(from), b, {}, Sink::copy_to(recv + from * b)});
  }
  c.run(sends, recvs);
}

}  // namespace cohort::collectives
