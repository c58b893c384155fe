// TcpConnection: message framing and non-blocking progress on one socket.
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "cohort/error.hpp"
#include "core/env.hpp"
#include "transport/tcp/tcp_transport.hpp"

namespace cohort::transport {
namespace {

const core::Knob kStaging{"COHORT_TCP_STAGING_BYTES", "256K",
                          "staging buffer per TCP connection for received data that is reduced (L2-sized)",
                          core::KnobKind::Bytes};

constexpr uint32_t kMsgMagic = 0x4d544843;  // "CHTM"

struct WireHeader {
  uint32_t magic;
  uint32_t kind;
  uint64_t seq;
  uint32_t tag;
  uint32_t pad;
  uint64_t bytes;
  uint64_t count;
};
static_assert(sizeof(WireHeader) == 40);

class TcpConnection final : public Connection {
 public:
  TcpConnection(int fd, int peer) : Connection(peer), fd_(fd), staging_(std::max<size_t>(4096, kStaging.bytes())) {}
  ~TcpConnection() override { ::close(fd_); }

  Kind kind() const override { return Kind::Tcp; }
  int poll_fd() const override { return fd_; }

  bool progress_send(SendOp& op) override {
    // op.state[0]: header bytes sent so far.
    WireHeader h{kMsgMagic, op.key.kind, op.key.seq, op.key.tag, 0, op.bytes, op.key.count};
    bool moved = false;
    while (!op.complete) {
      iovec iov[2];
      int n = 0;
      size_t hdone = op.state[0];
      if (hdone < sizeof(h)) iov[n++] = {reinterpret_cast<uint8_t*>(&h) + hdone, sizeof(h) - hdone};
      if (op.done < op.bytes) iov[n++] = {const_cast<uint8_t*>(op.data) + op.done, op.bytes - op.done};
      msghdr m{};
      m.msg_iov = iov;
      m.msg_iovlen = static_cast<size_t>(n);
      ssize_t w = ::sendmsg(fd_, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (w < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
        throw_closed("sending to", errno);
      }
      size_t ws = static_cast<size_t>(w);
      size_t to_hdr = std::min(ws, sizeof(h) - hdone);
      op.state[0] += to_hdr;
      op.done += ws - to_hdr;
      moved = moved || ws > 0;
      if (op.state[0] == sizeof(h) && op.done == op.bytes) op.complete = true;
    }
    return moved;
  }

  bool progress_recv(RecvOp& op) override {
    // op.state[0]: header bytes received; op.state[1]: bytes parked in staging_.
    bool moved = false;
    const bool reduce = op.sink.mode == Sink::Reduce;
    const size_t esize = reduce ? dtype_size(op.sink.dtype) : 1;
    while (!op.complete) {
      iovec iov[2];
      int n = 0;
      size_t hdone = op.state[0];
      size_t parked = op.state[1];
      if (hdone < sizeof(hdr_)) iov[n++] = {reinterpret_cast<uint8_t*>(&hdr_) + hdone, sizeof(hdr_) - hdone};
      size_t want = op.bytes - op.done - parked;  // payload bytes not yet read
      size_t payload_room = 0;
      if (want > 0) {
        if (reduce) {
          payload_room = std::min(want, staging_.size() - parked);
          iov[n++] = {staging_.data() + parked, payload_room};
        } else {
          payload_room = want;
          iov[n++] = {op.sink.dst + op.done, want};
        }
      }
      if (n == 0) {  // zero-byte message with its header in
        op.complete = true;
        break;
      }
      msghdr m{};
      m.msg_iov = iov;
      m.msg_iovlen = static_cast<size_t>(n);
      ssize_t r = ::recvmsg(fd_, &m, MSG_DONTWAIT);
      if (r == 0) throw_closed("receiving from", 0);
      if (r < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
        throw_closed("receiving from", errno);
      }
      moved = true;
      size_t rs = static_cast<size_t>(r);
      size_t to_hdr = std::min(rs, sizeof(hdr_) - hdone);
      op.state[0] += to_hdr;
      size_t payload = rs - to_hdr;
      if (hdone < sizeof(hdr_) && op.state[0] == sizeof(hdr_)) check_header(op);
      if (reduce) {
        parked += payload;
        size_t whole = parked / esize * esize;
        if (whole > 0) {
          op.sink.deliver(staging_.data(), op.done, whole);
          op.done += whole;
          std::memmove(staging_.data(), staging_.data() + whole, parked - whole);
          parked -= whole;
        }
        op.state[1] = parked;
      } else {
        op.done += payload;
      }
      if (op.state[0] == sizeof(hdr_) && op.done == op.bytes) op.complete = true;
    }
    return moved;
  }

  void check_alive() override {}  // a dead peer shows up as EOF / ECONNRESET on the socket

  void abort(const std::string&) noexcept override { ::shutdown(fd_, SHUT_RDWR); }

  std::string describe() const override { return fmt::format("rank {} (tcp)", peer_); }

 private:
  void check_header(const RecvOp& op) {
    if (hdr_.magic != kMsgMagic)
      throw PeerError(fmt::format("{} sent a malformed message header (magic {:#x}); the stream is out of sync",
                                  describe(), hdr_.magic),
                      peer_);
    MsgKey got{hdr_.seq, hdr_.tag, hdr_.kind, hdr_.count};
    if (!(got == op.key) || hdr_.bytes != op.bytes)
      throw MessageMismatch(fmt::format("{} sent message #{} (tag {:#x}, count {}) of {} bytes, but this rank expected #{} "
                                        "(tag {:#x}, count {}) of {} bytes",
                                        describe(), hdr_.seq, hdr_.tag, hdr_.count, hdr_.bytes, op.key.seq, op.key.tag,
                                        op.key.count, op.bytes),
                            peer_, got, hdr_.bytes, op.key, op.bytes);
  }

  [[noreturn]] void throw_closed(const char* doing, int e) {
    if (e == 0)
      throw PeerError(fmt::format("{} closed the connection (the process exited, crashed or aborted) while {} it", describe(),
                                  "this rank was receiving from"),
                      peer_);
    throw PeerError(fmt::format("connection error {} {}: {}", doing, describe(), std::strerror(e)), peer_);
  }

  int fd_;
  WireHeader hdr_{};
  std::vector<uint8_t> staging_;
};

}  // namespace

std::unique_ptr<Connection> TcpTransport::take(int peer) {
  auto it = fds_.find(peer);
  if (it == fds_.end()) throw InvalidArgument(fmt::format("tcp transport: no connection to rank {}", peer));
  int fd = it->second;
  fds_.erase(it);
  return std::make_unique<TcpConnection>(fd, peer);
}

}  // namespace cohort::transport
