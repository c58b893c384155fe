#include "transport/tcp/tcp_congestion.hpp"

#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "core/env.hpp"
#include "core/log.hpp"

namespace cohort::transport {
namespace {

const core::Knob kCongestion{
    "COHORT_TCP_CONGESTION", "auto",
    "TCP congestion control for rank-to-rank sockets: auto (cubic where the system gives bbr, whose pacing held "
    "collectives over a veth link to 0.4-0.6x of cubic's speed; otherwise the system's), system (leave it), or "
    "an algorithm's name (cubic, reno, ...; see net.ipv4.tcp_available_congestion_control)"};

std::string current(int fd) {
  char name[32] = {};
  socklen_t len = sizeof(name) - 1;
  if (::getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name, &len) != 0) return "";
  return std::string(name, strnlen(name, len));
}

}  // namespace

CongestionChoice apply_congestion(int fd, const std::string& spec) {
  CongestionChoice c{current(fd), ""};
  if (spec.empty() || spec == "system") return c;
  std::string want = spec;
  if (spec == "auto") {
    if (c.now.rfind("bbr", 0) != 0) return c;  // bbr, bbr2, bbr3: the ones that pace
    want = "cubic";
  }
  if (c.now == want) return c;
  if (::setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, want.data(), static_cast<socklen_t>(want.size())) != 0) {
    const int e = errno;
    c.problem = fmt::format(
        "cannot set TCP congestion control {} on rank-to-rank sockets ({}): they keep {}{}", want, std::strerror(e),
        c.now.empty() ? "the system's" : c.now,
        e == EPERM  ? "; HINT: add it to net.ipv4.tcp_allowed_congestion_control, or run with CAP_NET_ADMIN"
        : e == ENOENT ? "; HINT: the kernel does not have it (net.ipv4.tcp_available_congestion_control lists "
                        "what it has; modprobe tcp_" + want + ")"
                      : "");
    return c;
  }
  c.now = current(fd);
  return c;
}

void tune_congestion(int fd) {
  const std::string spec = kCongestion.str();
  const CongestionChoice c = apply_congestion(fd, spec);
  static std::atomic<bool> said{false};
  if (c.problem.empty() || said.exchange(true)) return;
  if (spec == "auto")
    COHORT_INFO(kNet, "tcp: {} (COHORT_TCP_CONGESTION=auto)", c.problem);
  else
    COHORT_WARN(kNet, "tcp: {} (COHORT_TCP_CONGESTION={})", c.problem, spec);
}

}  // namespace cohort::transport
