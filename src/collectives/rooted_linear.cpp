// Linear gather and scatter: the root exchanges one block with every other
// rank, all messages in flight at once (the root's link is the bottleneck
// either way, so a tree would only add latency for the sizes these are used at).
#include <cstring>
#include <vector>

#include "collectives/algorithms.hpp"

namespace cohort::collectives {

void gather_linear(Comm& c, const uint8_t* send, uint8_t* recv, size_t b, int root) {
  const int n = c.size(), rank = c.rank();
  if (rank != root) {
    c.send(root, send, b);
    return;
  }
  if (send != recv + rank * b) std::memcpy(recv + rank * b, send, b);
  std::vector<transport::SendOp> sends;
  std::vector<transport::RecvOp> recvs;
  for (int p = 0; p < n; ++p)
    if (p != rank) recvs.push_back({c.conn(p), b, {}, Sink::copy_to(recv + p * b)});
  c.run(sends, recvs);
}

void scatter_linear(Comm& c, const uint8_t* send, uint8_t* recv, size_t b, int root) {
  const int n = c.size(), rank = c.rank();
  if (rank != root) {
    c.recv(root, recv, b);
    return;
  }
  if (recv != send + rank * b) std::memcpy(recv, send + rank * b, b);
  std::vector<transport::SendOp> sends;
  std::vector<transport::RecvOp> recvs;
  for (int p = 0; p < n; ++p)
    if (p != rank) sends.push_back({c.conn(p), send + p * b, b});
  c.run(sends, recvs);
}

}  // namespace cohort::collectives
