// What the single-copy algorithms share (allreduce_single_copy.cpp,
// reduce_scatter_single_copy.cpp, allgather_single_copy.cpp): every peer is
// on this host and the kernel lets ranks access each other's memory
// (ShmTransport::single_copy), so a rank reads its peers' buffers itself
// instead of receiving messages.
//
// The shape of each: swap the buffers' addresses (one small allgather),
// access the peers' memory (mapped once when it is a shared buffer, else
// process_vm_readv/writev), then say "done" to every peer and wait for
// theirs, after which no peer touches this rank's buffers any more.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "collectives/comm.hpp"
#include "transport/shared_buffer.hpp"

namespace cohort::collectives {

// The piece a single-copy reduction works on at a time: it fits L2 with the
// destination piece.
inline constexpr size_t kSingleCopyPiece = 256 * 1024;

// One rank's buffer as its peers see it: its address in the owner's process,
// and the shared buffer holding it (id 0 when it is ordinary memory).
struct PeerBuffer {
  uint64_t addr = 0;
  transport::SharedRef ref;
};

// Collective: every rank's (p, bytes), indexed by rank.
std::vector<PeerBuffer> swap_buffers(Comm& c, const void* p, size_t bytes);

// Collective: every rank's send and receive buffers of `bytes` each, in one exchange.
struct SendRecvBuffers {
  std::vector<PeerBuffer> send, recv;
};
SendRecvBuffers swap_send_recv(Comm& c, const void* send, const void* recv, size_t bytes);

// True when every rank's buffer is a shared buffer (then the peers can map
// them; the same answer on every rank, which all see the same list).
bool all_shared(const std::vector<PeerBuffer>& buffers);

// The peer's buffer mapped into this process (loads and stores reach its
// memory), or nullptr when it is not a shared buffer or cannot be mapped
// (then use Comm::read_peer / write_peer). A failed mapping is logged once.
uint8_t* map_shared(Comm& c, int peer, const transport::SharedRef& ref, uint64_t addr, size_t bytes);

// Every peer's buffer of `bufs` mapped into this process (map_shared), with
// nullptr for this rank.
std::vector<uint8_t*> map_peers(Comm& c, const std::vector<PeerBuffer>& bufs, size_t bytes);

// One piece of a single-copy reduction: out[0, m) = mine[0, m) op, for every
// peer q in the order rank + 1, rank + 2, ..., bytes [at, at + m) of q's
// buffer: loaded from mapped[q] + at where it is mapped here, else read with
// process_vm_readv into `scratch` (m bytes). out may be mine; 2 ranks or more.
void reduce_piece(Comm& c, uint8_t* out, const uint8_t* mine, const std::vector<uint8_t*>& mapped,
                  const std::vector<PeerBuffer>& bufs, size_t at, size_t m, uint8_t* scratch, DType t, ReduceOp op);

// Stores src[0, m) at byte `at` of peer q's buffer: through mapped[q] where it
// is mapped here, else with process_vm_writev.
void store_to_peer(Comm& c, int q, const std::vector<uint8_t*>& mapped, const std::vector<PeerBuffer>& bufs, size_t at,
                   const uint8_t* src, size_t m);

// Collective: tells every peer that this rank is done with its buffers, and
// waits until every peer has said the same.
void single_copy_done(Comm& c);

}  // namespace cohort::collectives
