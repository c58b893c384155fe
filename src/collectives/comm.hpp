// Comm: what an algorithm sees of its group for one operation: its rank, the
// group size, a connection per peer, and blocking send/recv helpers built on
// transport::Engine. Algorithms never see a socket or a segment.
//
// Used by the one thread that executes the group's operations (the progress
// thread, or the caller on the inline path).
#pragma once

#include <cstdint>
#include <vector>

#include "core/clock.hpp"
#include "transport/engine.hpp"
#include "transport/transport.hpp"

namespace cohort::collectives {

using transport::Sink;

class Comm {
 public:
  Comm(int rank, int size, std::vector<transport::Connection*> conns, transport::Engine* engine)
      : rank_(rank), size_(size), conns_(std::move(conns)), engine_(engine) {}

  int rank() const { return rank_; }
  int size() const { return size_; }
  transport::Connection* conn(int peer) const { return conns_[peer]; }

  // Sets the key and deadline of the operation the next messages belong to.
  void begin(transport::MsgKey key, core::Deadline deadline) {
    key_ = key;
    deadline_ = deadline;
  }
  const transport::MsgKey& key() const { return key_; }

  void send(int to, const void* data, size_t bytes);
  void recv(int from, void* data, size_t bytes);
  void recv_reduce(int from, void* dst, const void* other, size_t bytes, DType t, ReduceOp op);
  // Both at once (neither side can block the other).
  void sendrecv(int to, const void* sdata, size_t sbytes, int from, Sink sink, size_t rbytes);
  // Any set of messages at once; fills in the key of each.
  void run(std::vector<transport::SendOp>& sends, std::vector<transport::RecvOp>& recvs);

  // Single copy: `bytes` of peer's memory at address `remote` into `local`, or
  // back (Connection::read_remote / write_remote; only when the group's shm
  // transport allows it).
  void read_peer(int peer, uint64_t remote, void* local, size_t bytes) { conns_[peer]->read_remote(remote, local, bytes); }
  void write_peer(int peer, uint64_t remote, const void* local, size_t bytes) {
    conns_[peer]->write_remote(remote, local, bytes);
  }

  // Direct access to a peer's shared buffer (Connection::map_remote): this
  // process's address for the peer's `remote`, or nullptr (reason in *why).
  uint8_t* map_peer(int peer, const transport::SharedRef& ref, uint64_t remote, size_t bytes, std::string* why) {
    return conns_[peer]->map_remote(ref, remote, bytes, why);
  }

  // A scratch buffer of at least `bytes`, reused across operations (not
  // zeroed). The algorithms use slot 0; an algorithm built from others (the
  // node-aware ones) keeps its own data in slot 1.
  uint8_t* scratch(size_t bytes, int slot = 0);

 private:
  int rank_, size_;
  std::vector<transport::Connection*> conns_;
  transport::Engine* engine_;
  transport::MsgKey key_{};
  core::Deadline deadline_ = core::Deadline::never();
  std::vector<uint8_t> scratch_[2];
};

// Splits `count` elements into `parts` nearly equal chunks (the first count % parts
// chunks get one more element). Returns the offset of chunk i; chunk_len likewise.
inline size_t chunk_off(size_t count, int parts, int i) {
  size_t base = count / parts, rem = count % parts;
  return base * i + std::min<size_t>(i, rem);
}
inline size_t chunk_len(size_t count, int parts, int i) {
  return count / parts + (static_cast<size_t>(i) < count % parts ? 1 : 0);
}

}  // namespace cohort::collectives
