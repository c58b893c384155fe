// TcpConnection: message framing and non-blocking progress on the sockets to one peer.
//
// A pair of ranks may be joined by several sockets (COHORT_NSOCKS_PER_PEER).
// A message of at least COHORT_NSOCKS_MIN_BYTES is cut into one stripe per
// socket (64-byte aligned, so stripes hold whole elements of every dtype);
// smaller ones travel whole on socket 0. Both ends derive the stripes from the
// message size alone, and every stripe carries its own header (key, total size,
// offset, length), which the receiver checks.
#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "cohort/error.hpp"
#include "core/env.hpp"
#include "transport/tcp/tcp_transport.hpp"

namespace cohort::transport {
namespace {

const core::Knob kStaging{"COHORT_TCP_STAGING_BYTES", "256K",
                          "staging buffer per TCP socket for received data that is reduced (L2-sized)",
                          core::KnobKind::Bytes};
const core::Knob kStripeMin{
    "COHORT_NSOCKS_MIN_BYTES", "256K",
    "messages of at least this size are striped over the COHORT_NSOCKS_PER_PEER sockets of a peer",
    core::KnobKind::Bytes};

constexpr uint32_t kMsgMagic = 0x4d544843;  // "CHTM"

struct WireHeader {
  uint32_t magic;
  uint32_t kind;
  uint64_t seq;
  uint32_t tag;
  uint32_t pad;
  uint64_t bytes;  // the whole message
  uint64_t count;
  uint64_t offset;  // this stripe
  uint64_t len;
};
static_assert(sizeof(WireHeader) == 56);

// Progress of one stripe of the message in flight on one socket.
struct Stripe {
  size_t off = 0, len = 0;
  size_t hdr_done = 0;  // header bytes moved
  size_t done = 0;      // payload bytes moved (delivered, for receives)
  size_t parked = 0;    // receive with Reduce: bytes waiting in the socket's staging buffer
  bool complete = false;
};

struct Sock {
  core::Fd fd;
  WireHeader hdr{};  // receive side: the header being read
  std::vector<uint8_t> staging;
  Stripe send, recv;
};

class TcpConnection final : public Connection {
 public:
  TcpConnection(std::vector<core::Fd> fds, int peer) : Connection(peer), stripe_min_(kStripeMin.bytes()) {
    size_t staging = std::max<size_t>(4096, kStaging.bytes());
    for (core::Fd& fd : fds) socks_.push_back(Sock{std::move(fd), {}, std::vector<uint8_t>(staging), {}, {}});
  }

  Kind kind() const override { return Kind::Tcp; }
  int poll_fd() const override { return socks_[0].fd.get(); }
  void poll_fds(std::vector<pollfd>& out, short events) const override {
    for (const auto& s : socks_) out.push_back(pollfd{s.fd.get(), events, 0});
  }

  bool progress_send(SendOp& op) override {
    return progress(op, &Sock::send, [&](Sock& s) { return send_stripe(s, op); });
  }

  bool progress_recv(RecvOp& op) override {
    return progress(op, &Sock::recv, [&](Sock& s) { return recv_stripe(s, op); });
  }

  void check_alive() override {}  // a dead peer shows up as EOF / ECONNRESET on a socket

  void abort(const std::string&) noexcept override {
    for (auto& s : socks_) ::shutdown(s.fd.get(), SHUT_RDWR);
  }

  std::string describe() const override { return fmt::format("rank {} (tcp)", peer_); }

 private:
  size_t stripes_for(size_t bytes) const { return bytes >= stripe_min_ ? socks_.size() : 1; }

  // Moves every stripe of `op` that can move (`which`: the send or the receive
  // side of each socket). A new message (state[1] == 0) is cut into stripes first.
  template <class Op, class Step>
  bool progress(Op& op, Stripe Sock::*which, Step&& step) {
    if (op.state[1] == 0) {
      op.state[1] = 1;
      size_t n = stripes_for(op.bytes);
      for (size_t i = 0; i < socks_.size(); ++i)
        socks_[i].*which = i < n ? stripe(op.bytes, n, i) : Stripe{0, 0, 0, 0, 0, true};
    }
    bool moved = false, all = true;
    size_t done = 0;
    for (auto& s : socks_) {
      if (!(s.*which).complete) moved |= step(s);
      all &= (s.*which).complete;
      done += (s.*which).done;
    }
    op.done = done;
    op.complete = all;
    return moved;
  }

  static Stripe stripe(size_t bytes, size_t n, size_t i) {
    size_t chunk = ((bytes + n - 1) / n + 63) / 64 * 64;
    size_t off = std::min(bytes, i * chunk);
    return Stripe{off, std::min(chunk, bytes - off)};
  }

  bool send_stripe(Sock& s, const SendOp& op) {
    Stripe& st = s.send;
    WireHeader h{kMsgMagic, op.key.kind, op.key.seq, op.key.tag, 0, op.bytes, op.key.count, st.off, st.len};
    bool moved = false;
    while (!st.complete) {
      iovec iov[2];
      int n = 0;
      if (st.hdr_done < sizeof(h)) iov[n++] = {reinterpret_cast<uint8_t*>(&h) + st.hdr_done, sizeof(h) - st.hdr_done};
      if (st.done < st.len) iov[n++] = {const_cast<uint8_t*>(op.data) + st.off + st.done, st.len - st.done};
      msghdr m{};
      m.msg_iov = iov;
      m.msg_iovlen = static_cast<size_t>(n);
      ssize_t w = ::sendmsg(s.fd.get(), &m, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (w < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
        throw_closed("sending to", errno);
      }
      size_t ws = static_cast<size_t>(w), to_hdr = std::min(ws, sizeof(h) - st.hdr_done);
      st.hdr_done += to_hdr;
      st.done += ws - to_hdr;
      moved = moved || ws > 0;
      st.complete = st.hdr_done == sizeof(h) && st.done == st.len;
    }
    return moved;
  }

  bool recv_stripe(Sock& s, const RecvOp& op) {
    Stripe& st = s.recv;
    const bool reduce = op.sink.mode == Sink::Reduce;
    const size_t esize = reduce ? dtype_size(op.sink.dtype) : 1;
    bool moved = false;
    while (!st.complete) {
      iovec iov[2];
      int n = 0;
      const size_t hdone = st.hdr_done;
      if (hdone < sizeof(WireHeader))
        iov[n++] = {reinterpret_cast<uint8_t*>(&s.hdr) + hdone, sizeof(WireHeader) - hdone};
      size_t want = st.len - st.done - st.parked;  // payload bytes not read yet
      if (want > 0) {
        if (reduce)
          iov[n++] = {s.staging.data() + st.parked, std::min(want, s.staging.size() - st.parked)};
        else
          iov[n++] = {op.sink.dst + st.off + st.done, want};
      }
      if (n == 0) {  // an empty stripe whose header is in
        st.complete = true;
        break;
      }
      msghdr m{};
      m.msg_iov = iov;
      m.msg_iovlen = static_cast<size_t>(n);
      ssize_t r = ::recvmsg(s.fd.get(), &m, MSG_DONTWAIT);
      if (r == 0) throw_closed("receiving from", 0);
      if (r < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
        throw_closed("receiving from", errno);
      }
      moved = true;
      size_t rs = static_cast<size_t>(r), to_hdr = std::min(rs, sizeof(WireHeader) - hdone);
      st.hdr_done += to_hdr;
      size_t payload = rs - to_hdr;
      if (hdone < sizeof(WireHeader) && st.hdr_done == sizeof(WireHeader)) check_header(s.hdr, st, op);
      if (reduce) {
        st.parked += payload;
        size_t whole = st.parked / esize * esize;
        if (whole > 0) {
          op.sink.deliver(s.staging.data(), st.off + st.done, whole);
          st.done += whole;
          std::memmove(s.staging.data(), s.staging.data() + whole, st.parked - whole);
          st.parked -= whole;
        }
      } else {
        st.done += payload;
      }
      st.complete = st.hdr_done == sizeof(WireHeader) && st.done == st.len;
    }
    return moved;
  }

  void check_header(const WireHeader& h, const Stripe& st, const RecvOp& op) const {
    if (h.magic != kMsgMagic)
      throw PeerError(fmt::format("{} sent a malformed message header (magic {:#x}); the stream is out of sync",
                                  describe(), h.magic),
                      peer_);
    MsgKey got{h.seq, h.tag, h.kind, h.count};
    if (!(got == op.key) || h.bytes != op.bytes || h.offset != st.off || h.len != st.len)
      throw MessageMismatch(
          fmt::format("{} sent message #{} (tag {:#x}, count {}) of {} bytes (stripe {}+{}), but this rank "
                      "expected #{} (tag {:#x}, count {}) of {} bytes (stripe {}+{})",
                      describe(), h.seq, h.tag, h.count, h.bytes, h.offset, h.len, op.key.seq, op.key.tag, op.key.count,
                      op.bytes, st.off, st.len),
          peer_, got, h.bytes, op.key, op.bytes);
  }

  [[noreturn]] void throw_closed(const char* doing, int e) const {
    if (e == 0)
      throw PeerError(
          fmt::format("{} closed the connection (the process exited, crashed or aborted) while this rank was "
                      "receiving from it",
                      describe()),
          peer_);
    throw PeerError(fmt::format("connection error {} {}: {}", doing, describe(), std::strerror(e)), peer_);
  }

  std::vector<Sock> socks_;
  size_t stripe_min_;
};

}  // namespace

std::unique_ptr<Connection> TcpTransport::take(int peer) {
  auto it = fds_.find(peer);
  if (it == fds_.end()) throw InvalidArgument(fmt::format("tcp transport: no connection to rank {}", peer));
  std::vector<core::Fd> fds = std::move(it->second);  // the connection owns them from here
  fds_.erase(it);
  return std::make_unique<TcpConnection>(std::move(fds), peer);
}

}  // namespace cohort::transport
