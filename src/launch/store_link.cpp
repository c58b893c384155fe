#include "launch/store_link.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "core/clock.hpp"
#include "core/fd.hpp"
#include "core/log.hpp"
#include "launch/rendezvous.hpp"

namespace cohort::launch {

std::unique_ptr<TcpStoreServer> host_store(const std::string& bind, int port) {
  try {
    auto server = std::make_unique<TcpStoreServer>(bind, static_cast<uint16_t>(port));
    COHORT_INFO(kLaunch, "hosting the rendezvous store on {}:{}", bind, server->port());
    return server;
  } catch (const Error& e) {
    throw IoError(fmt::format("cannot host the launcher's store on {}:{} ({}); another job may be using the port: "
                              "pass --standalone (one node), or move it with --rdzv-endpoint HOST:PORT or "
                              "--master-port (the store uses MASTER_PORT+1)",
                              bind, port, e.what()));
  }
}

std::shared_ptr<Store> connect_store(const std::string& host, int port, std::chrono::milliseconds timeout,
                                     SignalChannel& signals, std::chrono::milliseconds op_timeout) {
  auto deadline = core::Deadline::after(timeout);
  std::string last_error;
  for (;;) {
    try {
      TcpStoreOptions o;
      o.host = host;
      o.port = static_cast<uint16_t>(port);
      // Every call the launcher makes is a quick look (check, set, get of a key
      // known to exist); a store that does not answer in 15 s is gone, and the
      // monitor loop must not stall longer than that (the elastic agent passes
      // its heartbeat timeout).
      o.timeout = op_timeout;
      o.connect_timeout = std::chrono::seconds(1);  // short tries, so stop signals are seen between them
      return std::make_shared<TcpStore>(o);
    } catch (const Error& e) {
      last_error = e.what();
    }
    if (deadline.passed())
      throw TimeoutError(fmt::format("cannot reach the launcher's store at {}:{} within {} s: start the launcher with "
                                     "--node-rank 0 there, check --master-addr/--rdzv-endpoint and that the port is "
                                     "open between the hosts, or raise COHORT_RDZV_TIMEOUT (last error: {})",
                                     host, port, timeout.count() / 1000.0, last_error));
    int sig = signals.wait_stop_signal(deadline.remaining_ms(500));
    if (sig != 0) throw Interrupted(sig);
  }
}

int pick_free_port(const std::string& host) {
  const core::Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) throw IoError(fmt::format("cohort run: socket failed: {}", std::strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0)
    throw IoError(fmt::format("cohort run: cannot find a free port on {}: {}", host, std::strerror(errno)));
  return ntohs(addr.sin_port);
}

}  // namespace cohort::launch
