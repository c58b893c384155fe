// Ring allreduce (bandwidth-optimal for large messages).
//
// The buffer is cut into n chunks, one per rank. Ranks form a ring: each
// sends to its right neighbour (rank + 1) and receives from its left (rank - 1).
//
// Reduce-scatter, steps s = 0 .. n-2: send chunk (rank - s), receive chunk
// (rank - s - 1) and reduce it with our own input. Step 0 sends our own input;
// later steps send the chunk we reduced in the step before. After n-1 steps
// chunk (rank + 1) holds the reduction over all ranks.
//
// Allgather, steps s = 0 .. n-2: send chunk (rank + 1 - s), receive chunk
// (rank - s) and store it. Afterwards every chunk is complete everywhere.
//
// Avg (avg_div = n) divides each piece of a chunk as its last reduction lands,
// so the allgather already moves averages and no second pass is needed.
//
// Each rank sends and receives 2 (n-1)/n of the buffer: the busbw factor.
// The transports pipeline each chunk in slot / staging sized pieces, so that
// the neighbour reduces piece k while piece k+1 is on its way.
#include "collectives/algorithms.hpp"

#include <cstring>

namespace cohort::collectives {

void ring_reduce_scatter_phase(Comm& c, const uint8_t* send, uint8_t* recv, size_t count, DType t, ReduceOp op,
                               int avg_div) {
  const int n = c.size(), rank = c.rank();
  const size_t es = dtype_size(t);
  if (n == 1) {
    if (send != recv) std::memcpy(recv, send, count * es);
    return;
  }
  const int right = (rank + 1) % n, left = (rank - 1 + n) % n;
  auto mod = [n](int x) { return ((x % n) + n) % n; };
  auto off = [&](int chunk) { return chunk_off(count, n, chunk) * es; };
  auto len = [&](int chunk) { return chunk_len(count, n, chunk) * es; };
  for (int s = 0; s < n - 1; ++s) {
    int send_chunk = mod(rank - s), recv_chunk = mod(rank - s - 1);
    const uint8_t* src = (s == 0 ? send : recv) + off(send_chunk);
    const int div = s == n - 2 ? avg_div : 0;  // the last step completes the chunk: divide it for Avg
    c.sendrecv(right, src, len(send_chunk), left,
               Sink::reduce_into(recv + off(recv_chunk), send + off(recv_chunk), t, op, div), len(recv_chunk));
  }
}

void ring_allgather_phase(Comm& c, uint8_t* recv, size_t count, DType t) {
  const int n = c.size(), rank = c.rank();
  if (n == 1) return;
  const size_t es = dtype_size(t);
  const int right = (rank + 1) % n, left = (rank - 1 + n) % n;
  auto mod = [n](int x) { return ((x % n) + n) % n; };
  auto off = [&](int chunk) { return chunk_off(count, n, chunk) * es; };
  auto len = [&](int chunk) { return chunk_len(count, n, chunk) * es; };
  for (int s = 0; s < n - 1; ++s) {
    int send_chunk = mod(rank + 1 - s), recv_chunk = mod(rank - s);
    c.sendrecv(right, recv + off(send_chunk), len(send_chunk), left, Sink::copy_to(recv + off(recv_chunk)),
               len(recv_chunk));
  }
}

void allreduce_ring(Comm& c, const uint8_t* send, uint8_t* recv, size_t count, DType t, ReduceOp op, int avg_div) {
  ring_reduce_scatter_phase(c, send, recv, count, t, op, avg_div);
  ring_allgather_phase(c, recv, count, t);
}

}  // namespace cohort::collectives
