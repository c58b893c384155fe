// The transport interface: how bytes move between this rank and one peer.
//
// Algorithms (src/collectives/) see only this file. A Connection moves whole
// messages, each announced by a header carrying a MsgKey, so that a receiver
// can check that the message it gets is the one it expects (same operation
// sequence number and byte count) instead of silently mixing up operations.
//
// Progress is non-blocking and driven by the caller: progress_send/recv move
// what they can right now and return whether anything moved. Engine::run (in
// engine.hpp) loops over a set of operations, spinning briefly and then
// sleeping through the transports' wait hooks, so that 8 ranks on 2 cores all
// make progress.
#pragma once

#include <cstddef>
#include <cstdint>
#include <poll.h>

#include <string>
#include <vector>

#include "cohort/error.hpp"
#include "cohort/types.hpp"
#include "transport/shared_buffer.hpp"

namespace cohort::transport {

enum class Kind : uint8_t { Shm = 0, Tcp = 1 };
const char* kind_name(Kind k);

// Identifies a message. Collectives use kind 0, the group's sequence number,
// a fingerprint of the call (collective, dtype, op, root) as tag and the
// call's element count, so that a receiver notices ranks that issued
// different calls. Point-to-point messages use kind 1, a per-pair counter and
// the user's tag.
struct MsgKey {
  uint64_t seq = 0;
  uint32_t tag = 0;
  uint32_t kind = 0;
  uint64_t count = 0;
  bool operator==(const MsgKey&) const = default;
};

// The message that arrived is not the one this rank expected. The group
// layer turns both keys into a message naming both calls.
class MessageMismatch : public PeerError {
 public:
  MessageMismatch(const std::string& what, int peer, MsgKey got, uint64_t got_bytes, MsgKey want, uint64_t want_bytes)
      : PeerError(what, peer), got(got), want(want), got_bytes(got_bytes), want_bytes(want_bytes) {}
  MsgKey got, want;
  uint64_t got_bytes, want_bytes;
};

// What a receiver does with the bytes of a message as they arrive.
struct Sink {
  enum Mode : uint8_t { Copy, Reduce };
  Mode mode = Copy;
  uint8_t* dst = nullptr;          // byte i of the message lands at dst[i] (Copy) ...
  const uint8_t* other = nullptr;  // ... or dst[i] = other[i] (op) incoming[i] (Reduce); other may be dst
  DType dtype = DType::U8;
  ReduceOp op = ReduceOp::Sum;
  // Reduce only: when > 1, each delivered piece is then divided by avg_div
  // (Avg's last step, done while the piece is still in cache instead of in a
  // second pass over the whole output).
  int avg_div = 0;

  static Sink copy_to(void* dst) { return Sink{Copy, static_cast<uint8_t*>(dst), nullptr}; }
  static Sink reduce_into(void* dst, const void* other, DType t, ReduceOp op, int avg_div = 0) {
    return Sink{Reduce, static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(other), t, op, avg_div};
  }
  // Delivers bytes [offset, offset + len) of the message. len is a whole number
  // of elements for Reduce (transports keep partial elements back).
  void deliver(const uint8_t* data, size_t offset, size_t len) const;
};

class Connection;

// One message to send. `done` and `state` belong to the transport while in flight.
struct SendOp {
  Connection* conn = nullptr;
  const uint8_t* data = nullptr;
  size_t bytes = 0;
  MsgKey key;
  size_t done = 0;        // payload bytes handed to the transport
  bool complete = false;
  uint64_t state[2] = {0, 0};
};

// One message to receive: exactly `bytes` bytes with `key`.
struct RecvOp {
  Connection* conn = nullptr;
  size_t bytes = 0;
  MsgKey key;
  Sink sink;
  size_t done = 0;        // payload bytes delivered to the sink
  bool complete = false;
  uint64_t state[2] = {0, 0};
};

class Connection {
 public:
  virtual ~Connection() = default;
  virtual Kind kind() const = 0;
  int peer() const { return peer_; }

  // Move as much as possible now, without blocking. True if anything moved.
  // Throws PeerError when the peer is gone, aborted, or sent a message other
  // than the one expected (the message says which).
  virtual bool progress_send(SendOp& op) = 0;
  virtual bool progress_recv(RecvOp& op) = 0;

  // Called while waiting (every ~100 ms): throws PeerError if the peer's
  // process died or it aborted. Cheap.
  virtual void check_alive() = 0;
  // Tells the peer that this rank gave up (after an error), so that it fails
  // fast too. Idempotent, never throws.
  virtual void abort(const std::string& why) noexcept = 0;
  // A file descriptor to poll for readiness (TCP), or -1.
  virtual int poll_fd() const { return -1; }
  // Every descriptor to poll while waiting on this connection (default: poll_fd()).
  virtual void poll_fds(std::vector<pollfd>& out, short events) const {
    if (poll_fd() >= 0) out.push_back(pollfd{poll_fd(), events, 0});
  }
  // A short description of the peer for error messages: "rank 3 (pid 123, shm)".
  virtual std::string describe() const = 0;

  // Single copy: copies `bytes` bytes at address `remote` of the peer's process
  // into `local` (read), or `local` to `remote` (write), without the peer's
  // help (shm peers when the kernel allows process_vm_readv/writev;
  // ShmTransport::single_copy()). The peer must keep that memory alive, and
  // leave it alone, until it is told the access is over. Throws PeerError if
  // the peer is gone or the memory is not accessible; InvalidArgument on a
  // connection that cannot do it.
  virtual void read_remote(uint64_t remote, void* local, size_t bytes);
  virtual void write_remote(uint64_t remote, const void* local, size_t bytes);
  // Direct access: this process's address for the peer's address `remote`
  // (`bytes` from there) inside the peer's shared buffer `ref`
  // (shared_buffer.hpp), mapped on first use and kept; loads and stores
  // there reach the peer's memory. nullptr, with the reason in *why, when it
  // cannot be mapped (the caller then uses read_remote / write_remote).
  virtual uint8_t* map_remote(const SharedRef& ref, uint64_t remote, size_t bytes, std::string* why);

 protected:
  explicit Connection(int peer) : peer_(peer) {}
  int peer_;
};

// Per-kind waiting, used by the engine once spinning has not helped.
class Waiter {
 public:
  virtual ~Waiter() = default;
  // Announce that this rank is about to sleep; returns a token for sleep().
  virtual uint32_t prepare_sleep() = 0;
  // Sleep until a peer rings our doorbell (or timeout_us passes). token from prepare_sleep.
  virtual void sleep(uint32_t token, int timeout_us) = 0;
  virtual void finish_sleep() = 0;
};

}  // namespace cohort::transport
