#include "launch/options.hpp"

#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include <fmt/format.h>

#include "cohort/error.hpp"
#include "launch/binding.hpp"

namespace cohort::launch {
namespace {

// Whole-string non-negative integer, or -1.
long parse_count(const std::string& s) {
  if (s.empty() || s.size() > 9) return -1;
  for (char c : s)
    if (c < '0' || c > '9') return -1;
  return std::strtol(s.c_str(), nullptr, 10);
}

bool is_executable_file(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(path.c_str(), X_OK) == 0;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

int StdSpec::for_rank(int local_rank) const {
  auto it = per_rank.find(local_rank);
  return it != per_rank.end() ? it->second : all;
}

bool StdSpec::any() const {
  if (all != kStdNone) return true;
  for (const auto& [rank, mask] : per_rank)
    if (mask != kStdNone) return true;
  return false;
}

StdSpec parse_std_spec(const std::string& text, const std::string& flag) {
  auto bad = [&](const std::string& why) {
    return InvalidArgument(fmt::format("{} {}: {}; use 0 (none), 1 (stdout), 2 (stderr), 3 (both), "
                                       "or per local rank like 0:3,1:2",
                                       flag, text, why));
  };
  StdSpec spec;
  long whole = parse_count(text);
  if (whole >= 0) {
    if (whole > 3) throw bad("the value must be 0..3");
    spec.all = static_cast<int>(whole);
    return spec;
  }
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    auto colon = item.find(':');
    if (colon == std::string::npos) throw bad(fmt::format("'{}' is not LOCAL_RANK:VALUE", item));
    long rank = parse_count(item.substr(0, colon));
    long value = parse_count(item.substr(colon + 1));
    if (rank < 0) throw bad(fmt::format("'{}' has no local rank before ':'", item));
    if (value < 0 || value > 3) throw bad(fmt::format("'{}' has a value outside 0..3", item));
    if (spec.per_rank.count(static_cast<int>(rank))) throw bad(fmt::format("local rank {} is listed twice", rank));
    spec.per_rank[static_cast<int>(rank)] = static_cast<int>(value);
  }
  if (spec.per_rank.empty()) throw bad("the value is empty");
  return spec;
}

int cpu_count() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

int parse_nproc(const std::string& text) {
  // Each worker is a process with its own environment, pipes and shared
  // memory: far past any node's cores or GPUs the launcher would only run the
  // machine out of memory or processes before the job could start.
  constexpr long kMost = 4096;
  if (text == "auto" || text == "cpu") return static_cast<int>(std::min<long>(cpu_count(), kMost));
  if (text == "gpu")
    throw InvalidArgument("--nproc-per-node gpu: this build of cohort has no GPU support; "
                          "give a number, or auto / cpu for one worker per CPU");
  long n = parse_count(text);
  if (n < 1)
    throw InvalidArgument(fmt::format("--nproc-per-node {}: expected a positive number of workers per node, "
                                      "or auto / cpu (one per CPU)", text));
  if (n > kMost)
    throw InvalidArgument(fmt::format("--nproc-per-node {}: at most {} workers per node (this process may use {} CPUs); "
                                      "HINT: one worker per GPU or per core (--nproc-per-node auto), and more nodes "
                                      "(--nnodes) for more ranks",
                                      text, kMost, cpu_count()));
  return static_cast<int>(n);
}

NodeRange parse_nnodes(const std::string& text) {
  auto colon = text.find(':');
  if (colon == std::string::npos) {
    long n = parse_count(text);
    if (n < 1) throw InvalidArgument(fmt::format("--nnodes {}: expected a positive number of nodes, or MIN:MAX", text));
    return {static_cast<int>(n), static_cast<int>(n)};
  }
  long lo = parse_count(text.substr(0, colon));
  long hi = parse_count(text.substr(colon + 1));
  if (lo < 1 || hi < 1 || lo > hi)
    throw InvalidArgument(fmt::format("--nnodes {}: expected N or MIN:MAX with 1 <= MIN <= MAX", text));
  return {static_cast<int>(lo), static_cast<int>(hi)};
}

int min_nodes(const LaunchOptions& o) {
  return o.min_nnodes > 0 ? o.min_nnodes : o.nnodes;
}

bool is_elastic(const LaunchOptions& o) {
  return o.rdzv_backend == "c10d" && (o.nnodes > 1 || min_nodes(o) < o.nnodes);
}

HostPort parse_endpoint(const std::string& text, int default_port) {
  auto bad = [&] {
    return InvalidArgument(fmt::format("--rdzv-endpoint {}: expected HOST:PORT (or [IPV6]:PORT) with a port in 1..65535", text));
  };
  HostPort hp;
  std::string port_text;
  if (!text.empty() && text[0] == '[') {
    auto close = text.find(']');
    if (close == std::string::npos) throw bad();
    hp.host = text.substr(1, close - 1);
    if (close + 1 < text.size()) {
      if (text[close + 1] != ':') throw bad();
      port_text = text.substr(close + 2);
    }
  } else {
    auto colon = text.rfind(':');
    if (colon != std::string::npos && text.find(':') != colon) throw bad();  // bare IPv6 needs brackets
    hp.host = text.substr(0, colon);
    if (colon != std::string::npos) port_text = text.substr(colon + 1);
  }
  if (hp.host.empty()) throw bad();
  if (port_text.empty()) {
    hp.port = default_port;
  } else {
    long p = parse_count(port_text);
    if (p < 1 || p > 65535) throw bad();
    hp.port = static_cast<int>(p);
  }
  return hp;
}

void validate(const LaunchOptions& o) {
  if (o.command.empty())
    throw InvalidArgument("missing PROGRAM: usage is `cohort run [flags] PROGRAM [ARGS...]`, e.g. "
                          "`cohort run --nproc-per-node 2 train.py --epochs 3`");
  const std::string& program = o.command[0];
  if (program.size() > 1 && program[0] == '-')
    throw InvalidArgument(fmt::format("unknown flag {} (cohort run takes its flags before PROGRAM; "
                                      "see `cohort run --help`)", program));
  if (o.nproc_per_node < 1)
    throw InvalidArgument(fmt::format("--nproc-per-node {}: expected at least 1 worker per node", o.nproc_per_node));
  if (o.nnodes < 1) throw InvalidArgument(fmt::format("--nnodes {}: expected at least 1 node", o.nnodes));
  if (min_nodes(o) < 1 || min_nodes(o) > o.nnodes)
    throw InvalidArgument(fmt::format("--nnodes {}:{}: expected 1 <= MIN <= MAX", min_nodes(o), o.nnodes));
  if (min_nodes(o) < o.nnodes && o.rdzv_backend != "c10d")
    throw InvalidArgument(
        fmt::format("--nnodes {}:{}: elastic membership (MIN < MAX) needs the dynamic rendezvous: "
                    "add --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id JOB, or give a "
                    "fixed node count, e.g. --nnodes {}",
                    min_nodes(o), o.nnodes, o.nnodes));
  if (!is_elastic(o) && (o.node_rank < 0 || o.node_rank >= o.nnodes))
    throw InvalidArgument(fmt::format("--node-rank {} is outside 0..{} (--nnodes {}); give each node a distinct "
                                      "rank from 0 to nnodes-1", o.node_rank, o.nnodes - 1, o.nnodes));
  if (o.master_port < 1 || o.master_port > 65535)
    throw InvalidArgument(fmt::format("--master-port {}: expected a port in 1..65535", o.master_port));
  if (o.rdzv_backend != "static" && o.rdzv_backend != "c10d")
    throw InvalidArgument(
        fmt::format("--rdzv-backend {}: cohort supports static (node 0's launcher hosts the "
                    "store, --node-rank given) and c10d (dynamic: any start order, ranks assigned)",
                    o.rdzv_backend));
  if (o.max_restarts < 0)
    throw InvalidArgument(fmt::format("--max-restarts {}: expected 0 or more", o.max_restarts));
  if (o.standalone && o.nnodes != 1)
    throw InvalidArgument(fmt::format("--standalone runs one node, but --nnodes is {}; drop one of them", o.nnodes));
  if (o.no_python && o.module)
    throw InvalidArgument("--no-python and -m/--module cannot be used together (-m runs `python3 -m MODULE`)");
  if (o.run_id.empty()) throw InvalidArgument("--rdzv-id / --run-id must not be empty");
  if (o.role.empty()) throw InvalidArgument("--role must not be empty");
  for (const StdSpec* spec : {&o.tee, &o.redirects})
    for (const auto& [rank, mask] : spec->per_rank)
      if (rank >= o.nproc_per_node)
        throw InvalidArgument(fmt::format("{} names local rank {}, but there are only {} workers per node (0..{})",
                                          spec == &o.tee ? "--tee" : "--redirects", rank, o.nproc_per_node,
                                          o.nproc_per_node - 1));
  if (!o.rdzv_endpoint.empty()) parse_endpoint(o.rdzv_endpoint, o.master_port + 1);  // throws on bad syntax
  parse_bind(o.bind);  // throws on anything but none / numa / core
  if (!(o.min_busbw >= 0))
    throw InvalidArgument(fmt::format("--min-busbw {}: expected a bandwidth in GB/s, 0 or more", o.min_busbw));
  if (o.min_busbw > 0 && !o.preflight)
    throw InvalidArgument(fmt::format("--min-busbw {} applies to the pre-flight check only: add --preflight", o.min_busbw));
}

// "[::1]" -> "::1": torchrun's help writes IPv6 addresses in brackets, and
// programs (gloo, our store) want the bare address in MASTER_ADDR.
static std::string unbracketed(const std::string& addr) {
  if (addr.size() >= 2 && addr.front() == '[' && addr.back() == ']') return addr.substr(1, addr.size() - 2);
  return addr;
}

Endpoints resolve_endpoints(const LaunchOptions& o) {
  Endpoints e;
  const std::string master_addr = unbracketed(o.master_addr);
  if (o.standalone) {
    e.master_addr = o.master_addr_given ? master_addr : "127.0.0.1";
    e.store_bind = e.store_addr = "127.0.0.1";
    return e;  // ports 0: chosen by the agent
  }
  HostPort store{master_addr, o.master_port + 1};
  if (!o.rdzv_endpoint.empty()) store = parse_endpoint(o.rdzv_endpoint, o.master_port + 1);
  if (store.port > 65535)
    throw InvalidArgument(fmt::format("--master-port {} leaves no room for the launcher's store on port {}; "
                                      "use a lower port or give --rdzv-endpoint HOST:PORT", o.master_port, store.port));
  e.master_addr = o.master_addr_given || o.rdzv_endpoint.empty() ? master_addr : store.host;
  e.master_port = o.master_port;
  if (e.master_port == store.port) {
    if (o.master_port_given)
      throw InvalidArgument(fmt::format("--master-port {} and the --rdzv-endpoint port are the same; the program's "
                                        "store (MASTER_PORT) and the launcher's store need different ports",
                                        o.master_port));
    e.master_port = store.port + 1 <= 65535 ? store.port + 1 : store.port - 1;
  }
  if (o.nnodes == 1) {
    e.store_bind = e.store_addr = "127.0.0.1";
  } else {
    e.store_bind = "0.0.0.0";
    e.store_addr = store.host;
  }
  e.store_port = store.port;
  return e;
}

std::vector<std::string> worker_argv(const LaunchOptions& o, const std::string& python_exec) {
  std::vector<std::string> argv;
  const std::string& program = o.command.at(0);
  if (!o.no_python && (o.module || ends_with(program, ".py"))) {
    argv = {python_exec, "-u"};
    if (o.module) argv.push_back("-m");
  }
  argv.insert(argv.end(), o.command.begin(), o.command.end());
  return argv;
}

std::string resolve_program(const std::string& name, const std::string& path_env) {
  if (name.find('/') != std::string::npos) {
    errno = 0;
    if (!is_executable_file(name))
      throw InvalidArgument(fmt::format("cannot run {}: {}; check the path and that it is an executable file "
                                        "(chmod +x)", name, errno != 0 ? std::strerror(errno) : "not a regular file"));
    return name;
  }
  std::stringstream ss(path_env);
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + name;
    if (is_executable_file(candidate)) return candidate;
  }
  throw InvalidArgument(fmt::format("program '{}' was not found in PATH; give its path (e.g. ./{}) or install it",
                                    name, name));
}

}  // namespace cohort::launch
