// Pipelined chain broadcast (bandwidth-optimal for large messages).
//
// Ranks form a chain starting at the root: v = (rank - root) mod n, and rank v
// forwards to v + 1. The buffer is cut into segments; at step k a rank
// receives segment k from its predecessor while it forwards segment k - 1 to
// its successor (the root sends segment k at step k). After nseg + n - 2 steps
// of one segment each, everyone has the buffer: time ~ (bytes + (n-2) segment) / bw.
#include "collectives/algorithms.hpp"

#include <algorithm>
#include <vector>

namespace cohort::collectives {

void broadcast_pipeline(Comm& c, uint8_t* buf, size_t bytes, int root, size_t segment) {
  const int n = c.size();
  const int v = (c.rank() - root + n) % n;
  const bool has_next = v + 1 < n;
  const int next = (c.rank() + 1) % n, prev = (c.rank() - 1 + n) % n;
  const size_t nseg = bytes == 0 ? 1 : (bytes + segment - 1) / segment;
  auto seg_off = [&](size_t k) { return k * segment; };
  auto seg_len = [&](size_t k) { return std::min(segment, bytes - k * segment); };

  std::vector<transport::SendOp> sends;
  std::vector<transport::RecvOp> recvs;
  if (v == 0) {
    for (size_t k = 0; k < nseg; ++k) c.send(next, buf + seg_off(k), seg_len(k));
    return;
  }
  for (size_t k = 0; k <= nseg; ++k) {
    sends.clear();
    recvs.clear();
    if (k < nseg) recvs.push_back({c.conn(prev), seg_len(k), {}, Sink::copy_to(buf + seg_off(k))});
    if (has_next && k >= 1) sends.push_back({c.conn(next), buf + seg_off(k - 1), seg_len(k - 1)});
    c.run(sends, recvs);
  }
}

}  // namespace cohort::collectives
