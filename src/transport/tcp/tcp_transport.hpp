// TCP transport: one socket per peer pair, for ranks on different hosts (or
// on one host with COHORT_TRANSPORT=tcp).
//
// Set-up (COHORT_NSOCKS_PER_PEER sockets per pair; docs/algorithms.md): every rank listens on the interface chosen by COHORT_SOCKET_IFNAME
// (or the one that routes to the store's host), publishes "tcp/<rank>" =
// "ip:port" in the store, connects to every lower rank it needs and accepts
// the higher ones. The connector sends a hello (magic, version, group id, its
// rank) that the acceptor checks before the socket is used.
//
// Messages: a 32-byte header (magic, kind, seq, tag, byte count) then the
// payload. Sockets are non-blocking, TCP_NODELAY; the receiver reads payloads
// straight into the destination for copies and through a staging buffer for
// reductions.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cohort/store.hpp"
#include "core/clock.hpp"
#include "core/fd.hpp"
#include "transport/transport.hpp"

namespace cohort::transport {

struct TcpOptions {
  int my_rank = 0;
  int size = 1;
  std::vector<int> peers;      // group ranks to connect with over TCP
  std::string group_id;        // both ends of a socket must agree on it
  std::string route_hint;      // host to route towards when choosing the interface (the store's host)
};

class TcpTransport {
 public:
  static std::unique_ptr<TcpTransport> open(const TcpOptions& opts, Store& store, core::Deadline deadline);
  // The connection to `peer`, made by open(). Call once per peer.
  std::unique_ptr<Connection> take(int peer);
  const std::string& local_address() const { return local_addr_; }

 private:
  TcpTransport() = default;
  std::map<int, std::vector<core::Fd>> fds_;  // peer -> its connected sockets, by index
  std::string local_addr_;
};

// The IPv4 address to use: COHORT_SOCKET_IFNAME ("eth0", prefix "eth", "=eth0"
// exact, "^docker" to exclude) or the interface that routes to `route_hint`.
// Throws InvalidArgument naming the interfaces found when nothing matches.
std::string choose_local_address(const std::string& route_hint);

}  // namespace cohort::transport
