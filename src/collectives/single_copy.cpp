#include "collectives/single_copy.hpp"

#include <atomic>
#include <cstring>
#include <string>

#include "collectives/algorithms.hpp"
#include "core/log.hpp"
#include "core/reduce.hpp"

namespace cohort::collectives {

std::vector<PeerBuffer> swap_buffers(Comm& c, const void* p, size_t bytes) {
  const PeerBuffer mine{reinterpret_cast<uint64_t>(p), transport::find_shared_buffer(p, bytes)};
  std::vector<PeerBuffer> all(static_cast<size_t>(c.size()));
  allgather_direct(c, reinterpret_cast<const uint8_t*>(&mine), reinterpret_cast<uint8_t*>(all.data()), sizeof mine);
  return all;
}

SendRecvBuffers swap_send_recv(Comm& c, const void* send, const void* recv, size_t bytes) {
  struct Both {
    PeerBuffer send, recv;
  };
  const Both mine{{reinterpret_cast<uint64_t>(send), transport::find_shared_buffer(send, bytes)},
                  {reinterpret_cast<uint64_t>(recv), transport::find_shared_buffer(recv, bytes)}};
  std::vector<Both> all(static_cast<size_t>(c.size()));
  allgather_direct(c, reinterpret_cast<const uint8_t*>(&mine), reinterpret_cast<uint8_t*>(all.data()), sizeof mine);
  SendRecvBuffers out;
  for (const Both& b : all) {
    out.send.push_back(b.send);
    out.recv.push_back(b.recv);
  }
  return out;
}

bool all_shared(const std::vector<PeerBuffer>& buffers) {
  for (const PeerBuffer& b : buffers)
    if (b.ref.id == 0) return false;
  return true;
}

uint8_t* map_shared(Comm& c, int q, const transport::SharedRef& ref, uint64_t addr, size_t bytes) {
  if (ref.id == 0) return nullptr;
  std::string why;
  uint8_t* p = c.map_peer(q, ref, addr, bytes, &why);
  // Worth one line per process each way: mapped (fastest), or not (works, slower).
  static std::atomic<bool> told{false}, warned{false};
  if (p != nullptr && !told.exchange(true))
    COHORT_LOG(Info, kNet,
               "single copy maps peer {}'s shared buffer ({:.1f} MiB): collectives on shared buffers load "
               "and store the peers' memory directly",
               q, ref.len / 1048576.0);
  if (p == nullptr && !warned.exchange(true))
    COHORT_LOG(Warn, kNet,
               "cannot map peer {}'s shared buffer ({}); its collectives go through process_vm_readv "
               "instead (correct, slower)",
               q, why);
  return p;
}

std::vector<uint8_t*> map_peers(Comm& c, const std::vector<PeerBuffer>& bufs, size_t bytes) {
  std::vector<uint8_t*> mapped(bufs.size(), nullptr);
  for (int q = 0; q < c.size(); ++q)
    if (q != c.rank()) mapped[q] = map_shared(c, q, bufs[q].ref, bufs[q].addr, bytes);
  return mapped;
}

void reduce_piece(Comm& c, uint8_t* out, const uint8_t* mine, const std::vector<uint8_t*>& mapped,
                  const std::vector<PeerBuffer>& bufs, size_t at, size_t m, uint8_t* scratch, DType t, ReduceOp op) {
  const int n = c.size();
  for (int k = 1; k < n; ++k) {
    const int q = (c.rank() + k) % n;
    const uint8_t* theirs = mapped[q] ? mapped[q] + at : scratch;
    if (!mapped[q]) c.read_peer(q, bufs[q].addr + at, scratch, m);
    core::reduce(out, k == 1 ? mine : out, theirs, m / dtype_size(t), t, op);
  }
}

void store_to_peer(Comm& c, int q, const std::vector<uint8_t*>& mapped, const std::vector<PeerBuffer>& bufs, size_t at,
                   const uint8_t* src, size_t m) {
  if (mapped[q])
    std::memcpy(mapped[q] + at, src, m);
  else
    c.write_peer(q, bufs[q].addr + at, src, m);
}

void single_copy_done(Comm& c) {
  const uint8_t done = 1;
  std::vector<uint8_t> got(static_cast<size_t>(c.size()));
  allgather_direct(c, &done, got.data(), 1);
}

}  // namespace cohort::collectives
