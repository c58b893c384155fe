// TcpStoreServer: the key-value table behind TcpStore, served by one thread
// running an epoll loop over non-blocking sockets.
//
// Why one thread: store traffic is rendezvous traffic (small, bursty, bound by
// latency rather than bandwidth), and a single owner of the table needs no
// locks, so a set can never race the wait it satisfies. The thread blocks only
// in epoll_wait; the destructor wakes it through an eventfd.
//
// A connection first sends Hello (tcp_protocol.hpp); after an ok Welcome it
// sends one request at a time. This file moves bytes; what they mean (and how
// GET and WAIT wait) is in tcp_store_server_requests.cpp.
//
// Anything malformed (bad magic, a frame over COHORT_STORE_MAX_FRAME, a body
// that does not decode, a request sent while one is pending) closes that one
// connection with a warning. Connections are closed only between epoll
// batches (drop() marks, reap() closes) so that a pointer to a connection held
// while waking waiters never dangles.
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <memory>

#include <fmt/format.h>

#include "cohort/error.hpp"
#include "core/log.hpp"
#include "store/tcp_store_server_impl.hpp"

namespace cohort {

namespace net = store::net;

namespace {
constexpr size_t kKeepCapacity = 1 << 20;  // buffers above this are freed once empty
constexpr int kAcceptPauseMs = 100;        // after EMFILE: let connections close before accepting again
}  // namespace

void TcpStoreServer::Impl::run() {
  epoll_event events[64];
  for (;;) {
    int n = ::epoll_wait(epoll_fd.get(), events, 64, accept_paused ? kAcceptPauseMs : -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      COHORT_WARN(kStore, "store server {}: epoll_wait failed: {}; the server stops and its clients will fail",
                  where, net::errno_text(errno));
      return;
    }
    if (accept_paused) {
      accept_paused = false;
      epoll_event ev{EPOLLIN, {.fd = listen_fd.get()}};
      ::epoll_ctl(epoll_fd.get(), EPOLL_CTL_MOD, listen_fd.get(), &ev);
    }
    for (int i = 0; i < n; ++i) {
      int fd = events[i].data.fd;
      if (fd == wake_fd.get()) return;
      if (fd == listen_fd.get()) {
        accept_all();
        continue;
      }
      auto it = conns.find(fd);
      if (it == conns.end() || it->second->dead) continue;
      try {
        on_event(*it->second, events[i].events);
      } catch (const std::exception& e) {  // e.g. bad_alloc on a huge value: lose the connection, not the server
        drop(*it->second, e.what(), true);
      }
    }
    reap();
  }
}

void TcpStoreServer::Impl::accept_all() {
  for (;;) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    int fd = ::accept4(listen_fd.get(), reinterpret_cast<sockaddr*>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      COHORT_WARN(kStore, "store server {}: accept failed: {} with {} connections open; pausing accepts for {} ms; "
                  "HINT: raise the open-file limit (ulimit -n)", where, net::errno_text(errno), conns.size(), kAcceptPauseMs);
      epoll_event ev{0, {.fd = listen_fd.get()}};
      ::epoll_ctl(epoll_fd.get(), EPOLL_CTL_MOD, listen_fd.get(), &ev);
      accept_paused = true;
      return;
    }
    auto c = std::make_unique<Conn>();
    c->fd = net::Fd(fd);
    c->peer = net::address_text(reinterpret_cast<sockaddr*>(&ss));
    net::set_nodelay(fd);
    epoll_event ev{EPOLLIN, {.fd = fd}};
    if (::epoll_ctl(epoll_fd.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
      COHORT_WARN(kStore, "store server {}: cannot watch connection from {}: {}", where, c->peer, net::errno_text(errno));
      continue;
    }
    c->events = EPOLLIN;
    COHORT_TRACE(kStore, "store server {}: connection from {}", where, c->peer);
    Conn& conn = *conns.emplace(fd, std::move(c)).first->second;
    conn.nonce = store::make_nonce();
    reply(conn, store::encode_challenge(conn.nonce));  // the client answers with a Hello (tcp_protocol.hpp)
  }
}

void TcpStoreServer::Impl::on_event(Conn& c, uint32_t ev) {
  if (ev & EPOLLOUT) flush(c);
  if (!c.dead && (ev & (EPOLLIN | EPOLLHUP | EPOLLERR))) read_some(c);
}

void TcpStoreServer::Impl::read_some(Conn& c) {
  for (int round = 0; round < 16 && !c.dead; ++round) {  // bounded, so one busy peer cannot starve the rest
    ssize_t n = ::recv(c.fd.get(), scratch.data(), scratch.size(), 0);
    if (n > 0) {
      c.in.insert(c.in.end(), scratch.begin(), scratch.begin() + n);
      parse(c);
      continue;
    }
    if (n == 0) return drop(c, "client closed the connection", false);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return;
    return drop(c, "recv failed: " + net::errno_text(errno), false);
  }
}

void TcpStoreServer::Impl::parse(Conn& c) {
  size_t off = 0;
  while (!c.dead && !c.close_after_flush) {
    const uint8_t* p = c.in.data() + off;
    size_t avail = c.in.size() - off;
    if (!c.greeted) {
      size_t used = parse_hello(c, p, avail);
      if (used == 0) break;
      off += used;
      continue;
    }
    if (avail < 4) break;
    uint32_t len = store::load_le32(p);
    if (len == 0 || len > max_frame)
      return drop(c, fmt::format("frame header claims {} bytes (limit COHORT_STORE_MAX_FRAME={})", len, max_frame), true);
    if (avail - 4 < len) break;
    Request req;
    std::string why;
    if (!store::decode_request(p + 4, len, &req, &why)) return drop(c, "malformed request: " + why, true);
    off += 4 + size_t{len};
    handle(c, std::move(req));
  }
  if (c.dead || c.close_after_flush) return;
  c.in.erase(c.in.begin(), c.in.begin() + static_cast<ptrdiff_t>(off));
  if (c.in.empty() && c.in.capacity() > kKeepCapacity) Bytes().swap(c.in);
}

void TcpStoreServer::Impl::reply(Conn& c, Bytes frame) {
  if (c.out.empty()) c.out = std::move(frame);
  else c.out.insert(c.out.end(), frame.begin(), frame.end());
  flush(c);
}

void TcpStoreServer::Impl::flush(Conn& c) {
  while (c.out_off < c.out.size()) {
    ssize_t w = ::send(c.fd.get(), c.out.data() + c.out_off, c.out.size() - c.out_off, MSG_NOSIGNAL);
    if (w > 0) {
      c.out_off += static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return watch(c, EPOLLIN | EPOLLOUT);
    return drop(c, "send failed: " + net::errno_text(errno), false);
  }
  c.out.clear();
  c.out_off = 0;
  if (c.out.capacity() > kKeepCapacity) Bytes().swap(c.out);
  if (c.close_after_flush) return drop(c, "handshake refused", false);
  watch(c, EPOLLIN);
}

void TcpStoreServer::Impl::watch(Conn& c, uint32_t events) {
  if (c.events == events) return;
  epoll_event ev{events, {.fd = c.fd.get()}};
  if (::epoll_ctl(epoll_fd.get(), EPOLL_CTL_MOD, c.fd.get(), &ev) != 0)
    return drop(c, "epoll_ctl failed: " + net::errno_text(errno), true);
  c.events = events;
}

void TcpStoreServer::Impl::drop(Conn& c, const std::string& why, bool warn) {
  if (c.dead) return;
  if (warn)
    COHORT_WARN(kStore, "store server {}: closing the connection from {}: {}; "
                "HINT: only cohort TcpStore clients of the same version should connect to this port", where, c.peer, why);
  else
    COHORT_TRACE(kStore, "store server {}: closing the connection from {}: {}", where, c.peer, why);
  if (c.waiting) unlist(c);
  c.waiting = false;
  c.dead = true;
  doomed.push_back(c.fd.get());
}

void TcpStoreServer::Impl::reap() {
  for (int fd : doomed) {
    ::epoll_ctl(epoll_fd.get(), EPOLL_CTL_DEL, fd, nullptr);
    conns.erase(fd);  // closes the socket
  }
  doomed.clear();
}

TcpStoreServer::TcpStoreServer(const std::string& host, uint16_t port) : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.host = host;
  s.listen_fd = net::listen_on(host, port, &s.port);
  s.where = net::host_port(host, s.port);
  s.epoll_fd = net::Fd(::epoll_create1(EPOLL_CLOEXEC));
  s.wake_fd = net::Fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!s.epoll_fd.valid() || !s.wake_fd.valid())
    throw IoError(fmt::format("store server {}: cannot create epoll/eventfd: {}; HINT: raise the open-file limit (ulimit -n)",
                              s.where, net::errno_text(errno)));
  epoll_event lev{EPOLLIN, {.fd = s.listen_fd.get()}};
  epoll_event wev{EPOLLIN, {.fd = s.wake_fd.get()}};
  if (::epoll_ctl(s.epoll_fd.get(), EPOLL_CTL_ADD, s.listen_fd.get(), &lev) != 0 ||
      ::epoll_ctl(s.epoll_fd.get(), EPOLL_CTL_ADD, s.wake_fd.get(), &wev) != 0)
    throw IoError(fmt::format("store server {}: epoll_ctl failed: {}", s.where, net::errno_text(errno)));
  // Logged here, on the caller's thread, so that the logger reads its knobs
  // before the loop thread exists.
  COHORT_INFO(kStore, "store server listening on {}{}", s.where, s.secret.empty() ? "" : " (secret required)");
  s.loop = std::thread([&s] { s.run(); });
}

TcpStoreServer::~TcpStoreServer() {
  uint64_t one = 1;
  ssize_t w = ::write(impl_->wake_fd.get(), &one, sizeof(one));
  (void)w;  // an eventfd write only fails when the counter would overflow; the loop is awake then anyway
  impl_->loop.join();
  COHORT_INFO(kStore, "store server {} stopped; closing {} connection(s)", impl_->where, impl_->conns.size());
}

uint16_t TcpStoreServer::port() const { return impl_->port; }

}  // namespace cohort
