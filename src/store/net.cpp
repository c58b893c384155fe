#include "store/net.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "cohort/error.hpp"

namespace cohort::store::net {

std::string errno_text(int err) { return fmt::format("{} (errno {})", std::strerror(err), err); }

void set_nonblocking(int fd) {
  int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0)
    throw IoError("store: fcntl(O_NONBLOCK) failed: " + errno_text(errno));
}

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // best effort: only latency suffers
}

std::string address_text(const sockaddr* sa) {
  char ip[INET6_ADDRSTRLEN] = "?";
  if (sa->sa_family == AF_INET) {
    auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    ::inet_ntop(AF_INET, &in->sin_addr, ip, sizeof(ip));
    return fmt::format("{}:{}", ip, ntohs(in->sin_port));
  }
  if (sa->sa_family == AF_INET6) {
    auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, ip, sizeof(ip));
    return fmt::format("[{}]:{}", ip, ntohs(in6->sin6_port));
  }
  return "unknown address";
}

std::string peer_text(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "unknown peer";
  return address_text(reinterpret_cast<sockaddr*>(&ss));
}

std::string host_port(const std::string& host, uint16_t port) {
  return host.find(':') != std::string::npos ? fmt::format("[{}]:{}", host, port) : fmt::format("{}:{}", host, port);
}

namespace {

// Waits for `events` on fd until the deadline. 1 ready, 0 timeout, -1 error (*err set).
int wait_for(int fd, short events, core::Deadline deadline, int* err) {
  for (;;) {
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, deadline.remaining_ms());
    if (r > 0) return 1;
    if (r == 0) {
      if (deadline.passed()) return 0;
      continue;  // remaining_ms rounds: poll may wake a hair early
    }
    if (errno == EINTR) continue;
    *err = errno;
    return -1;
  }
}

}  // namespace

IoStatus send_all(int fd, const uint8_t* data, size_t n, core::Deadline deadline, int* err) {
  size_t off = 0;
  while (off < n) {
    ssize_t w = ::send(fd, data + off, n - off, MSG_NOSIGNAL);
    if (w > 0) {
      off += static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      int r = wait_for(fd, POLLOUT, deadline, err);
      if (r == 0) return IoStatus::Timeout;
      if (r < 0) return IoStatus::Error;
      continue;
    }
    *err = errno;
    return (errno == EPIPE || errno == ECONNRESET) ? IoStatus::Closed : IoStatus::Error;
  }
  return IoStatus::Ok;
}

IoStatus recv_all(int fd, uint8_t* data, size_t n, core::Deadline deadline, int* err, size_t* done) {
  *done = 0;
  while (*done < n) {
    ssize_t r = ::recv(fd, data + *done, n - *done, 0);
    if (r > 0) {
      *done += static_cast<size_t>(r);
      continue;
    }
    if (r == 0) return IoStatus::Closed;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      int w = wait_for(fd, POLLIN, deadline, err);
      if (w == 0) return IoStatus::Timeout;
      if (w < 0) return IoStatus::Error;
      continue;
    }
    *err = errno;
    return errno == ECONNRESET ? IoStatus::Closed : IoStatus::Error;
  }
  return IoStatus::Ok;
}

Fd connect_once(const std::string& host, uint16_t port, core::Deadline deadline, std::string* why) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  std::string service = std::to_string(port);
  // getaddrinfo has no timeout of its own; a resolver that hangs is bounded by
  // the system's resolv.conf settings, not by `deadline`.
  int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0) {
    *why = fmt::format("cannot resolve host '{}': {}", host, gai_strerror(rc));
    return Fd();
  }
  *why = "no address";
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol));
    if (!fd.valid()) {
      *why = "socket(): " + errno_text(errno);
      continue;
    }
    int err = 0;
    if (::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        *why = errno_text(errno);
        continue;
      }
      int r = wait_for(fd.get(), POLLOUT, deadline, &err);
      if (r == 0) {
        *why = "connect timed out";
        continue;
      }
      socklen_t len = sizeof(err);
      if (r < 0 || ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
        *why = errno_text(err != 0 ? err : errno);
        continue;
      }
    }
    set_nodelay(fd.get());
    ::freeaddrinfo(res);
    return fd;
  }
  ::freeaddrinfo(res);
  return Fd();
}

Fd listen_on(const std::string& host, uint16_t port, uint16_t* bound_port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  std::string asked = host_port(host, port);
  int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0)
    throw IoError(fmt::format("store server cannot listen on {}: cannot resolve host '{}': {}; "
                              "HINT: use 0.0.0.0 (every interface) or an address of this machine",
                              asked, host, gai_strerror(rc)));
  Fd listening;
  int err = 0;
  for (addrinfo* ai = res; ai != nullptr && !listening.valid(); ai = ai->ai_next) {
    Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol));
    int one = 1;
    // SO_REUSEADDR: a restarted job can take the port while the last one's
    // connections sit in TIME_WAIT. It does not let two servers share a port.
    if (fd.valid() && ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) == 0 &&
        ::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd.get(), SOMAXCONN) == 0)
      listening = std::move(fd);
    else
      err = errno;
  }
  ::freeaddrinfo(res);
  if (!listening.valid()) {
    std::string hint =
        err == EADDRINUSE
            ? "another process holds this port (an earlier run still exiting, or another job on this machine); "
              "pick another port (MASTER_PORT / --master-port), or port 0 to let the system choose"
        : err == EADDRNOTAVAIL ? "the host is not an address of this machine; listen on 0.0.0.0 or on one of its addresses"
        : err == EACCES        ? "ports below 1024 need privileges; use a port above 1024"
                               : "check the host and port";
    throw IoError(fmt::format("store server cannot listen on {}: {}; HINT: {}", asked, errno_text(err), hint));
  }
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  ::getsockname(listening.get(), reinterpret_cast<sockaddr*>(&ss), &len);
  *bound_port = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                         : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  return listening;
}

}  // namespace cohort::store::net
