#include "launch/doctor_probe.hpp"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <ifaddrs.h>

#include <chrono>
#include <cstring>
#include <fstream>

#include <fmt/format.h>

#include "cohort/error.hpp"
#include "core/env.hpp"
#include "core/fd.hpp"
#include "core/log.hpp"
#include "transport/tcp/tcp_transport.hpp"

namespace cohort::launch::doctor {
namespace {

const core::Knob kConnectTimeout{"COHORT_DOCTOR_CONNECT_TIMEOUT", "5s",
                                 "cohort doctor: deadline of each TCP probe (connect + one round trip) to a peer",
                                 core::KnobKind::Seconds};
const core::Knob kFault{"COHORT_DOCTOR_FAULT", "",
                        "test knob: closed-port:R makes rank R of `cohort doctor` advertise a port that refuses "
                        "connections, so the probes of the other ranks really fail"};

constexpr uint64_t kPingMagic = 0x474e495043444f43ull;  // "CODCPING"
constexpr uint64_t kMinShmFree = 64ull << 20;

int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::optional<int> env_int(const group::EnvMap& env, const char* name) {
  auto it = env.find(name);
  if (it == env.end() || it->second.empty()) return std::nullopt;
  try {
    return std::stoi(it->second);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// torchrun's contract holds together: the numbers agree with each other.
void check_torchrun_vars(const group::EnvMap& env, RankReport& r) {
  auto rank = env_int(env, "RANK"), world = env_int(env, "WORLD_SIZE"), lr = env_int(env, "LOCAL_RANK"),
       lws = env_int(env, "LOCAL_WORLD_SIZE"), gr = env_int(env, "GROUP_RANK"), gws = env_int(env, "GROUP_WORLD_SIZE");
  const std::string hint = "the launcher's variables contradict each other: were they set by hand, or left over from "
                           "another launcher in the environment?";
  if (lr && lws && *lr >= *lws)
    r.env_problems.push_back(fmt::format("LOCAL_RANK={} is not below LOCAL_WORLD_SIZE={}|{}", *lr, *lws, hint));
  if (lws && gws && world && *lws * *gws != *world)
    r.env_problems.push_back(fmt::format("LOCAL_WORLD_SIZE={} x GROUP_WORLD_SIZE={} is not WORLD_SIZE={}|{}", *lws,
                                         *gws, *world, hint));
  if (rank && lr && lws && gr && *gr * *lws + *lr != *rank)
    r.env_problems.push_back(fmt::format("RANK={} is not GROUP_RANK={} x LOCAL_WORLD_SIZE={} + LOCAL_RANK={}|{}", *rank,
                                         *gr, *lws, *lr, hint));
}

void check_dev_shm(const group::LaunchEnv& le, RankReport& r) {
  const int local = le.local_world_size.value_or(1);
  struct statvfs st {};
  if (statvfs("/dev/shm", &st) != 0) {
    r.shm_free_mib = -1;
    if (local > 1)
      r.env_problems.push_back(fmt::format("/dev/shm is missing ({}), but {} ranks share this host and talk through "
                                           "it|mount a tmpfs there (Docker: --shm-size=1g), or set COHORT_TRANSPORT=tcp",
                                           std::strerror(errno), local));
    return;
  }
  const uint64_t free_bytes = static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
  r.shm_free_mib = static_cast<double>(free_bytes) / 1048576.0;
  const std::string probe = fmt::format("/dev/shm/cohort-doctor-{}", getpid());
  const core::Fd fd(open(probe.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600));
  if (!fd.valid()) {
    r.env_problems.push_back(fmt::format("cannot create a file in /dev/shm: {}|check its permissions (it should be "
                                         "mode 1777) and that it is not full",
                                         std::strerror(errno)));
  } else {
    unlink(probe.c_str());
  }
  if (local > 1 && free_bytes < kMinShmFree)
    r.env_warnings.push_back(fmt::format("/dev/shm has only {:.1f} MiB free for {} local ranks|a container's default "
                                         "64 MiB is tight: give it more (Docker: --shm-size=1g)",
                                         r.shm_free_mib, local));
}

// "eth0 (10.0.0.1)": the interface that holds the address, for the verdict.
std::string interface_text(const std::string& address) {
  ifaddrs* ifs = nullptr;
  std::string name;
  if (getifaddrs(&ifs) == 0) {
    for (ifaddrs* i = ifs; i != nullptr && name.empty(); i = i->ifa_next) {
      if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
      char buf[INET_ADDRSTRLEN];
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof(buf));
      if (address == buf) name = i->ifa_name;
    }
    freeifaddrs(ifs);
  }
  return name.empty() ? address : fmt::format("{} ({})", name, address);
}

}  // namespace

std::string hostname() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return host;
}

std::string host_identity() {
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  char ns[128] = {0};
  ssize_t n = readlink("/proc/self/ns/net", ns, sizeof(ns) - 1);
  return fmt::format("{}|{}|{}", hostname(), boot, n > 0 ? std::string(ns, n) : "");
}

RankReport check_environment(const group::LaunchEnv& le, const group::EnvMap& env) {
  RankReport r;
  r.rank = le.rank;
  r.world_size = le.world_size;
  r.host = hostname();
  r.host_id = host_identity();
  r.launcher = le.source;
  if (le.source == "cohort run" || le.source == "torchrun") check_torchrun_vars(env, r);
  check_dev_shm(le, r);
  try {
    r.interface = transport::choose_local_address(le.master_addr);
    r.interface_name = interface_text(r.interface);
  } catch (const Error& e) {
    r.interface = "127.0.0.1";
    // Harmless while every rank is on this host (shm, no TCP between ranks); fatal once one is not.
    const bool one_host = le.local_world_size && *le.local_world_size == le.world_size;
    (one_host ? r.env_warnings : r.env_problems).push_back(fmt::format("{}|fix COHORT_SOCKET_IFNAME (or unset it to use the interface that routes "
                                         "to the store's host {})",
                                         e.what(), le.master_addr));
  }
  return r;
}

bool fault_closed_port(int rank) {
  const std::string spec = kFault.str();
  return spec == fmt::format("closed-port:{}", rank);
}

ProbeListener::ProbeListener(const std::string& address, bool closed) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw IoError(fmt::format("cohort doctor: socket() failed: {}", std::strerror(errno)));
  fd_.reset(fd);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  if (inet_pton(AF_INET, address.c_str(), &a.sin_addr) != 1)
    throw InvalidArgument(fmt::format("cohort doctor: '{}' is not an IPv4 address", address));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0)
    throw IoError(fmt::format("cohort doctor: cannot bind a probe listener on {}: {}; HINT: set COHORT_SOCKET_IFNAME "
                              "to an interface of this host",
                              address, std::strerror(errno)));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  advertised_ = fmt::format("{}:{}", address, ntohs(a.sin_port));
  if (closed) {
    COHORT_WARN(kInit, "COHORT_DOCTOR_FAULT: advertising {}, which is bound but not listening", advertised_);
    return;  // bound, never listening: connects are refused, and the port stays ours
  }
  if (::listen(fd, 1024) != 0)
    throw IoError(fmt::format("cohort doctor: cannot listen on {}: {}", advertised_, std::strerror(errno)));
  store::net::set_nonblocking(fd);
  thread_ = std::thread([this] { loop(); });
}

ProbeListener::~ProbeListener() { stop(); }

void ProbeListener::stop() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

// Serves one request at a time: probes are tiny, and a peer that connects
// but never sends is dropped after 2 s.
void ProbeListener::loop() {
  while (!stop_) {
    pollfd p{fd_.get(), POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    store::net::Fd c(accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!c.valid()) continue;
    uint64_t magic = 0;
    int err = 0;
    size_t done = 0;
    auto deadline = core::Deadline::after(std::chrono::seconds(2));
    if (store::net::recv_all(c.get(), reinterpret_cast<uint8_t*>(&magic), sizeof(magic), deadline, &err, &done) !=
            store::net::IoStatus::Ok ||
        magic != kPingMagic)
      continue;
    int64_t now = wall_ns();
    store::net::send_all(c.get(), reinterpret_cast<const uint8_t*>(&now), sizeof(now), deadline, &err);
  }
}

namespace {

// One connect + request/reply to pr.addr, bounded by `per_probe`; fills pr.
void probe_one(PeerProbe& pr, std::chrono::milliseconds per_probe) {
  const double limit_s = per_probe.count() / 1000.0;
  auto colon = pr.addr.rfind(':');
  const std::string host = pr.addr.substr(0, colon);
  const auto port = static_cast<uint16_t>(std::stoi(pr.addr.substr(colon + 1)));
  auto t0 = core::Clock::now();
  auto probe_deadline = core::Deadline::after(per_probe);
  std::string why;
  store::net::Fd fd = store::net::connect_once(host, port, probe_deadline, &why);
  if (!fd.valid()) {
    pr.error = why.empty() ? fmt::format("timed out after {} s", limit_s) : why;
    return;
  }
  int err = 0;
  size_t done = 0;
  const int64_t sent_at = wall_ns();
  int64_t peer_now = 0;
  auto st = store::net::send_all(fd.get(), reinterpret_cast<const uint8_t*>(&kPingMagic), sizeof(kPingMagic),
                                 probe_deadline, &err);
  if (st == store::net::IoStatus::Ok)
    st = store::net::recv_all(fd.get(), reinterpret_cast<uint8_t*>(&peer_now), sizeof(peer_now), probe_deadline, &err,
                              &done);
  const int64_t got_at = wall_ns();
  if (st != store::net::IoStatus::Ok) {
    pr.error = st == store::net::IoStatus::Timeout
                   ? fmt::format("connected, but no reply within {} s (timed out)", limit_s)
                   : fmt::format("connected, but the exchange failed: {}",
                                 err != 0 ? store::net::errno_text(err) : std::string("closed by the peer"));
    return;
  }
  pr.ok = true;
  pr.rtt_ms = core::seconds_since(t0) * 1000.0;
  pr.clock_offset_ms = static_cast<double>(peer_now - (sent_at + got_at) / 2) / 1e6;
}

}  // namespace

// Addresses first (from the store, each wait bounded by the overall
// deadline), then the probes, up to kParallel at a time: unreachable peers
// cost one COHORT_DOCTOR_CONNECT_TIMEOUT per batch, not one each.
std::vector<PeerProbe> probe_peers(Store& store, int me, int world_size, core::Deadline deadline) {
  using Ms = std::chrono::milliseconds;
  constexpr size_t kParallel = 16;
  const auto per_probe = kConnectTimeout.millis();
  std::vector<PeerProbe> out;
  for (int p = 0; p < world_size; ++p) {
    if (p == me) continue;
    PeerProbe pr;
    pr.peer = p;
    try {
      pr.addr = store.get_string(fmt::format("addr/{}", p), Ms(std::max(1, deadline.remaining_ms())));
      if (pr.addr.empty()) pr.error = "it has no probe listener (its own report says why)";
    } catch (const Error& e) {
      pr.error = fmt::format("no address within the deadline: {}", e.what());
    }
    out.push_back(pr);
  }
  for (size_t first = 0; first < out.size(); first += kParallel) {
    std::vector<std::thread> batch;
    for (size_t i = first; i < std::min(out.size(), first + kParallel); ++i)
      if (!out[i].addr.empty()) batch.emplace_back(probe_one, std::ref(out[i]), per_probe);
    for (auto& t : batch) t.join();
  }
  return out;
}

}  // namespace cohort::launch::doctor
