// TcpTransport set-up: interface choice, listen, connect / accept, hello.
#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <set>
#include <thread>

#include "cohort/error.hpp"
#include "core/env.hpp"
#include "core/job_secret.hpp"
#include "core/log.hpp"
#include "store/net.hpp"
#include "transport/tcp/tcp_congestion.hpp"
#include "transport/tcp/tcp_hello.hpp"
#include "transport/tcp/tcp_transport.hpp"

namespace cohort::transport {
namespace {

const core::Knob kIfname{"COHORT_SOCKET_IFNAME", "",
                         "network interface for TCP connections between ranks: eth0, a prefix (eth), =eth0 (exact) or "
                         "^docker (exclude); default: the interface that routes to the store's host"};
const core::Knob kNsocks{"COHORT_NSOCKS_PER_PEER", "2",
                         "TCP sockets between each pair of ranks; large messages are striped over them (2 measured best here: "
                         "1.7x the bandwidth of 1 over a veth pair at 64 MiB, up to 1.8x on loopback at 1 MiB)",
                         core::KnobKind::Int};
const core::Knob kSockBuf{"COHORT_SOCKET_BUFFER", "0",
                          "SO_SNDBUF / SO_RCVBUF for rank-to-rank sockets (0: leave them to the kernel's autotuning, "
                          "which measured best on loopback)",
                          core::KnobKind::Bytes};

std::string err(int e) {
  return std::strerror(e);
}

void tune_socket(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  int buf = static_cast<int>(kSockBuf.bytes());
  if (buf > 0) {
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
  }
}

bool if_matches(const std::string& spec, const std::string& name) {
  if (spec.empty()) return true;
  if (spec[0] == '^') return !if_matches(spec.substr(1), name);
  if (spec[0] == '=') return name == spec.substr(1);
  return name.rfind(spec, 0) == 0;
}

std::pair<std::string, uint16_t> split_hostport(const std::string& s) {
  auto c = s.rfind(':');
  return {s.substr(0, c), static_cast<uint16_t>(std::stoi(s.substr(c + 1)))};
}

// Connector side, socket k to the lower rank p: connect (retrying while its
// listener is not up yet), then answer its challenge with our proof of the
// job secret (tcp_hello.hpp). Throws TimeoutError or PeerError naming both ranks.
core::Fd connect_to_lower(const TcpOptions& opts, int p, int k, Store& store, core::Deadline deadline,
                          const std::string& secret, uint64_t group_hash) {
  auto [host, port] =
      split_hostport(store.get_string(fmt::format("tcp/{}", p), Millis(std::max(1, deadline.remaining_ms()))));
  sockaddr_in pa{};
  pa.sin_family = AF_INET;
  pa.sin_port = htons(port);
  inet_pton(AF_INET, host.c_str(), &pa.sin_addr);
  core::Fd fd;
  int last_err = 0;
  while (!fd.valid()) {
    fd.reset(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd.valid()) throw IoError(fmt::format("socket() failed: {}", err(errno)));
    tune_socket(fd.get());
    tune_congestion(fd.get());  // before connect(): accepted sockets inherit their listener's (open())
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&pa), sizeof(pa)) == 0) break;
    last_err = errno;
    fd.reset();
    if (deadline.passed()) {
      throw TimeoutError(
          fmt::format("rank {} cannot connect to rank {} at {}:{}: {}; HINT: is a firewall blocking the "
                      "port? set COHORT_SOCKET_IFNAME to the interface that reaches the other hosts",
                      opts.my_rank, p, host, port, err(last_err)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Answer the acceptor's challenge with our proof of the job secret (tcp_hello.hpp).
  store::net::set_nonblocking(fd.get());
  int e = 0;
  size_t got = 0;
  uint8_t challenge[tcp_hello::kChallengeBytes];
  tcp_hello::Nonce nonce{};
  tcp_hello::Verdict cv = tcp_hello::Verdict::Short;
  bool ok =
      store::net::recv_all(fd.get(), challenge, sizeof(challenge), deadline, &e, &got) == store::net::IoStatus::Ok &&
      (cv = tcp_hello::check_challenge(challenge, sizeof(challenge), &nonce)) == tcp_hello::Verdict::Ok;
  if (ok) {
    auto hello = tcp_hello::encode_hello(secret, nonce, {group_hash, opts.my_rank, static_cast<uint32_t>(k)});
    ok = store::net::send_all(fd.get(), hello.data(), hello.size(), deadline, &e) == store::net::IoStatus::Ok;
  }
  if (!ok) {
    throw PeerError(fmt::format("rank {}: handshake with rank {} at {}:{} failed: {}", opts.my_rank, p, host, port,
                                e                                 ? store::net::errno_text(e)
                                : cv != tcp_hello::Verdict::Short ? std::string(tcp_hello::verdict_text(cv))
                                                                  : std::string("timed out or closed")),
                    p);
  }
  return fd;
}

// Acceptor side: challenge the connector on fd; only a Hello proving the job
// secret makes the socket ours. Ok fills *h; anything else says what was wrong.
tcp_hello::Verdict challenge_connector(int fd, const std::string& secret, tcp_hello::HelloFields* h) {
  const tcp_hello::Nonce nonce = tcp_hello::make_nonce();
  const auto challenge = tcp_hello::encode_challenge(nonce);
  const auto hs_deadline = core::Deadline::after(std::chrono::seconds(5));
  uint8_t hello[tcp_hello::kHelloBytes];
  int e = 0;
  size_t got = 0;
  tcp_hello::Verdict v = tcp_hello::Verdict::Short;
  // The magic and version first, so that a stranger is turned away without waiting for the rest.
  size_t rest = 0;
  if (store::net::send_all(fd, challenge.data(), challenge.size(), hs_deadline, &e) == store::net::IoStatus::Ok &&
      store::net::recv_all(fd, hello, 8, hs_deadline, &e, &got) == store::net::IoStatus::Ok) {
    v = tcp_hello::check_hello(hello, 8, secret, nonce, h);  // Short when the header is right
    if (v == tcp_hello::Verdict::Short &&
        store::net::recv_all(fd, hello + 8, sizeof(hello) - 8, hs_deadline, &e, &rest) == store::net::IoStatus::Ok)
      v = tcp_hello::check_hello(hello, sizeof(hello), secret, nonce, h);
  }
  return v;
}

}  // namespace

std::string choose_local_address(const std::string& route_hint) {
  std::string spec = kIfname.str();
  if (spec.empty()) {
    // Ask the kernel which source address it would use towards the store's
    // host. connect() on a UDP socket sends nothing.
    std::string host = route_hint.empty() ? "127.0.0.1" : route_hint;
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_DGRAM;
    addrinfo* res = nullptr;
    if (getaddrinfo(host.c_str(), "9", &hints, &res) == 0 && res != nullptr) {
      core::Fd s(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
      std::string out;
      if (s.valid() && ::connect(s.get(), res->ai_addr, res->ai_addrlen) == 0) {
        sockaddr_in local{};
        socklen_t len = sizeof(local);
        if (getsockname(s.get(), reinterpret_cast<sockaddr*>(&local), &len) == 0) {
          char buf[INET_ADDRSTRLEN];
          inet_ntop(AF_INET, &local.sin_addr, buf, sizeof(buf));
          out = buf;
        }
      }
      freeaddrinfo(res);
      if (!out.empty()) return out;
    }
    return "127.0.0.1";
  }
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) != 0) throw IoError(fmt::format("getifaddrs failed: {}", err(errno)));
  std::string found, seen;
  for (ifaddrs* i = ifs; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP)) continue;
    char buf[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof(buf));
    seen += fmt::format("{}{} ({})", seen.empty() ? "" : ", ", i->ifa_name, buf);
    if (found.empty() && if_matches(spec, i->ifa_name)) found = buf;
  }
  freeifaddrs(ifs);
  if (found.empty())
    throw InvalidArgument(
        fmt::format("COHORT_SOCKET_IFNAME={} matches no IPv4 interface that is up; interfaces here: {}", spec, seen));
  return found;
}

std::unique_ptr<TcpTransport> TcpTransport::open(const TcpOptions& opts, Store& store, core::Deadline deadline) {
  std::unique_ptr<TcpTransport> t(new TcpTransport());
  t->local_addr_ = choose_local_address(opts.route_hint);
  const uint64_t group_hash = std::hash<std::string>{}(opts.group_id);
  const std::string secret = core::job_secret();

  // The listening socket: closed on every way out of here (core::Fd).
  core::Fd lfd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!lfd.valid()) throw IoError(fmt::format("socket() failed: {}", err(errno)));
  // Accepted sockets take the listener's congestion control from the start: set
  // after accept(), a socket that began with bbr would keep its pacing.
  tune_congestion(lfd.get());
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  inet_pton(AF_INET, t->local_addr_.c_str(), &addr.sin_addr);
  addr.sin_port = 0;
  if (::bind(lfd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(lfd.get(), 1024) != 0) {
    const int e = errno;
    throw IoError(fmt::format("cannot listen on {}: {}; HINT: set COHORT_SOCKET_IFNAME to an interface of this host",
                              t->local_addr_, err(e)));
  }
  socklen_t alen = sizeof(addr);
  getsockname(lfd.get(), reinterpret_cast<sockaddr*>(&addr), &alen);
  const std::string me = fmt::format("{}:{}", t->local_addr_, ntohs(addr.sin_port));
  store.set_string(fmt::format("tcp/{}", opts.my_rank), me);
  COHORT_INFO(kNet, "tcp: listening on {} (group {})", me, opts.group_id);

  const int nsocks = static_cast<int>(kNsocks.integer());
  if (nsocks < 1 || nsocks > 64)
    throw InvalidArgument(fmt::format("COHORT_NSOCKS_PER_PEER={} must be between 1 and 64", nsocks));
  std::map<int, int> to_accept;  // peer -> sockets still expected from it
  for (int p : opts.peers) {
    if (p > opts.my_rank) {
      to_accept[p] = nsocks;
      t->fds_[p].resize(nsocks);  // filled by socket index as they are accepted
      continue;
    }
    for (int k = 0; k < nsocks; ++k) t->fds_[p].push_back(connect_to_lower(opts, p, k, store, deadline, secret, group_hash));
  }

  while (!to_accept.empty()) {
    pollfd pfd{lfd.get(), POLLIN, 0};
    if (deadline.passed()) {
      std::string missing;
      for (auto& [p, left] : to_accept) missing += fmt::format("{}{}", missing.empty() ? "" : ",", p);
      throw TimeoutError(
          fmt::format("rank {} waited for TCP connections from ranks [{}] on {} until the timeout; "
                      "HINT: are those ranks running, and can they reach this address?",
                      opts.my_rank, missing, me));
    }
    if (::poll(&pfd, 1, std::min(100, deadline.remaining_ms())) <= 0) continue;
    core::Fd fd(::accept4(lfd.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!fd.valid()) continue;
    tune_socket(fd.get());
    store::net::set_nonblocking(fd.get());
    tcp_hello::HelloFields h;
    const tcp_hello::Verdict v = challenge_connector(fd.get(), secret, &h);
    std::string why;
    if (v != tcp_hello::Verdict::Ok)
      why = tcp_hello::verdict_text(v);
    else if (h.group_hash != group_hash)
      why = "a handshake for another group or job";
    else if (to_accept.count(h.rank) == 0 || h.socket >= static_cast<uint32_t>(nsocks) ||
             t->fds_[h.rank][h.socket].valid())
      why = fmt::format("an unexpected rank {} socket {}", h.rank, h.socket);
    if (!why.empty()) {
      sockaddr_in from{};
      socklen_t flen = sizeof(from);
      char buf[INET_ADDRSTRLEN] = "?";
      if (getpeername(fd.get(), reinterpret_cast<sockaddr*>(&from), &flen) == 0)
        inet_ntop(AF_INET, &from.sin_addr, buf, sizeof(buf));
      COHORT_WARN(kNet, "tcp: rank {} refused a connection from {} on {}: {}", opts.my_rank, buf, me, why);
      continue;  // fd closes here
    }
    t->fds_[h.rank][h.socket] = std::move(fd);
    if (--to_accept[h.rank] == 0) to_accept.erase(h.rank);
  }
  return t;
}

}  // namespace cohort::transport
