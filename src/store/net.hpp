// store/net.hpp: the few socket helpers the TcpStore client and server share.
// Linux only (epoll in the server, MSG_NOSIGNAL, accept4).
#pragma once

#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/clock.hpp"
#include "core/fd.hpp"

namespace cohort::store::net {

using core::Fd;  // the sockets below are held in core::Fd (core/fd.hpp)

std::string errno_text(int err);  // "Connection refused (errno 111)"
void set_nonblocking(int fd);
void set_nodelay(int fd);         // store traffic is small request/response: no Nagle delay
std::string address_text(const sockaddr* sa);  // "10.0.0.1:29500" or "[::1]:29500"
std::string peer_text(int fd);    // the remote address of a connected socket
std::string host_port(const std::string& host, uint16_t port);

enum class IoStatus { Ok, Timeout, Closed, Error };

// On a non-blocking socket: moves all n bytes or stops at the deadline, at the
// peer's close, or at an error (*err = errno). recv_all's *done counts the
// bytes that arrived, so that a caller can tell "nothing yet" from "cut off midway".
IoStatus send_all(int fd, const uint8_t* data, size_t n, core::Deadline deadline, int* err);
IoStatus recv_all(int fd, uint8_t* data, size_t n, core::Deadline deadline, int* err, size_t* done);

// One connection attempt to host:port (every address it resolves to), bounded
// by the deadline. Returns a connected non-blocking socket with TCP_NODELAY, or
// an invalid Fd and the reason in *why.
Fd connect_once(const std::string& host, uint16_t port, core::Deadline deadline, std::string* why);

// A non-blocking listening socket on host:port (SO_REUSEADDR; host "" or
// "0.0.0.0" is every IPv4 interface, "::" every IPv6 one; port 0 lets the
// system choose). *bound_port is the port it got. Throws IoError naming
// host:port, with a hint, when the port is taken or the host is not local.
Fd listen_on(const std::string& host, uint16_t port, uint16_t* bound_port);

}  // namespace cohort::store::net
