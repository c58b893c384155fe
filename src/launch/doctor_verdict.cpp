// `cohort doctor`: reports as JSON, and the verdict rank 0 prints (pure functions).
#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cohort/error.hpp"
#include "launch/doctor.hpp"

namespace cohort::launch {
namespace {

using nlohmann::json;

std::string host_of(const RankReport* r) { return r != nullptr && !r->host.empty() ? r->host : "?"; }

// "problem|hint" as env checks store them.
std::pair<std::string, std::string> split_hint(const std::string& s) {
  auto bar = s.find('|');
  if (bar == std::string::npos) return {s, ""};
  return {s.substr(0, bar), s.substr(bar + 1)};
}

void add_problem(Verdict& v, const std::string& what, const std::string& hint) {
  v.healthy = false;
  ++v.problems;
  v.lines.push_back("PROBLEM: " + what);
  if (!hint.empty()) v.lines.push_back("  HINT: " + hint);
}

void add_warning(Verdict& v, const std::string& what, const std::string& hint) {
  ++v.warnings;
  v.lines.push_back("WARNING: " + what);
  if (!hint.empty()) v.lines.push_back("  HINT: " + hint);
}

}  // namespace

std::string report_to_json(const RankReport& r) {
  json peers = json::array();
  for (const PeerProbe& p : r.peers)
    peers.push_back({{"peer", p.peer}, {"addr", p.addr}, {"ok", p.ok}, {"error", p.error}, {"rtt_ms", p.rtt_ms},
                     {"clock_offset_ms", p.clock_offset_ms}});
  json j = {{"rank", r.rank},         {"world_size", r.world_size}, {"host", r.host},
            {"host_id", r.host_id},   {"launcher", r.launcher},
            {"interface", r.interface}, {"interface_name", r.interface_name}, {"shm_free_mib", r.shm_free_mib},
            {"env_problems", r.env_problems}, {"env_warnings", r.env_warnings},
            {"peers", peers}};
  return j.dump();
}

RankReport report_from_json(const std::string& text) {
  try {
    json j = json::parse(text);
    RankReport r;
    r.rank = j.at("rank").get<int>();
    r.world_size = j.at("world_size").get<int>();
    r.host = j.at("host").get<std::string>();
    r.host_id = j.at("host_id").get<std::string>();
    r.launcher = j.at("launcher").get<std::string>();
    r.interface = j.at("interface").get<std::string>();
    r.interface_name = j.value("interface_name", r.interface);
    r.shm_free_mib = j.at("shm_free_mib").get<double>();
    r.env_problems = j.at("env_problems").get<std::vector<std::string>>();
    r.env_warnings = j.at("env_warnings").get<std::vector<std::string>>();
    for (const json& p : j.at("peers"))
      r.peers.push_back(PeerProbe{p.at("peer").get<int>(), p.at("addr").get<std::string>(), p.at("ok").get<bool>(),
                                  p.at("error").get<std::string>(), p.at("rtt_ms").get<double>(),
                                  p.at("clock_offset_ms").get<double>()});
    return r;
  } catch (const json::exception& e) {
    throw InvalidArgument(fmt::format("cohort doctor: a rank's report is not valid JSON ({}); are all ranks running "
                                      "the same cohort version?",
                                      e.what()));
  }
}

std::string connect_problem(const RankReport& from, const RankReport* to, const PeerProbe& p) {
  std::string head = fmt::format("rank {} on host {} cannot reach rank {} on host {}", from.rank, from.host, p.peer,
                                 host_of(to));
  if (p.addr.empty())
    return fmt::format("{}: rank {} published no probe address ({}); look at its own problems and its output",
                       head, p.peer, p.error);
  std::string hint;
  const std::string& e = p.error;
  if (e.find("refused") != std::string::npos)
    hint = "is a firewall blocking the port, or does the address belong to another interface than the one the peer "
           "listens on? set COHORT_SOCKET_IFNAME to the interface that connects the hosts";
  else if (e.find("timed out") != std::string::npos || e.find("unreachable") != std::string::npos ||
           e.find("No route") != std::string::npos)
    hint = "packets to that address are dropped or not routed: is a firewall dropping them, or is it an address of a "
           "network the other host is not on? set COHORT_SOCKET_IFNAME to the interface that connects the hosts";
  else
    hint = "check that the address is reachable from this host (ping, nc -vz) and set COHORT_SOCKET_IFNAME to the "
           "interface that connects the hosts";
  return fmt::format("{} at {}: {}; {}", head, p.addr, p.error, hint);
}

// Hosts that share a hostname but not a boot or network namespace (containers,
// network-namespace tests) get their namespace added to the name: "vm (net:[4026532])".
std::vector<RankReport> disambiguate_hosts(std::vector<RankReport> rs) {
  std::map<std::string, std::set<std::string>> ids_of_name;
  for (const RankReport& r : rs) ids_of_name[r.host].insert(r.host_id);
  for (RankReport& r : rs)
    if (ids_of_name[r.host].size() > 1) r.host += " (" + r.host_id.substr(r.host_id.rfind('|') + 1) + ")";
  return rs;
}

Verdict judge_reports(const std::vector<RankReport>& reports_in, const std::vector<int>& missing, int world_size,
                      const DoctorOptions& opts) {
  const std::vector<RankReport> reports = disambiguate_hosts(reports_in);
  Verdict v;
  std::map<int, const RankReport*> by_rank;
  for (const RankReport& r : reports) by_rank[r.rank] = &r;
  std::map<std::string, std::vector<int>> hosts;  // host_id -> ranks
  for (const RankReport& r : reports) hosts[r.host_id].push_back(r.rank);
  std::set<std::string> launchers;
  for (const RankReport& r : reports) launchers.insert(r.launcher);

  v.lines.push_back(fmt::format("cohort doctor: {} rank(s) on {} host(s), started by {}", world_size, hosts.size(),
                                launchers.empty() ? std::string("?") : fmt::format("{}", fmt::join(launchers, ", "))));
  for (const auto& [id, ranks] : hosts) {
    const RankReport* r = by_rank[ranks.front()];
    v.lines.push_back(fmt::format("  host {}: ranks {}; TCP interface {}; /dev/shm {}", r->host, fmt::join(ranks, ","),
                                  r->interface_name.empty() ? r->interface : r->interface_name,
                                  r->shm_free_mib < 0 ? std::string("missing")
                                                      : fmt::format("{:.0f} MiB free", r->shm_free_mib)));
  }
  for (int m : missing)
    add_problem(v, fmt::format("rank {} did not report within {} s", m, opts.timeout.count() / 1000.0),
                "it may have failed to start or crashed: look at its output above; a rank that cannot reach the "
                "store's host fails this way too");
  if (launchers.size() > 1)
    add_problem(v, fmt::format("the ranks were started by different launchers ({})", fmt::join(launchers, ", ")),
                "start every rank the same way (one `cohort run` per node, or one mpirun / srun)");
  for (const RankReport& r : reports) {
    if (r.world_size != world_size)
      add_problem(v, fmt::format("rank {} on host {} was told the world size is {}, rank 0 that it is {}", r.rank,
                                 r.host, r.world_size, world_size),
                  "every rank must get the same WORLD_SIZE: start all nodes with the same --nnodes and "
                  "--nproc-per-node");
    if (hosts.size() > 1 && r.interface.rfind("127.", 0) == 0)
      add_problem(v, fmt::format("rank {} on host {} would use the loopback address {} for TCP, but the job spans {} "
                                 "hosts", r.rank, r.host, r.interface, hosts.size()),
                  "set COHORT_SOCKET_IFNAME to the interface that connects the hosts, or give --master-addr / "
                  "MASTER_ADDR as an address the other hosts can reach (not localhost)");
    for (const std::string& s : r.env_problems) {
      auto [what, hint] = split_hint(s);
      add_problem(v, fmt::format("rank {} on host {}: {}", r.rank, r.host, what), hint);
    }
    for (const std::string& s : r.env_warnings) {
      auto [what, hint] = split_hint(s);
      add_warning(v, fmt::format("rank {} on host {}: {}", r.rank, r.host, what), hint);
    }
  }

  int probes = 0, failed = 0;
  double worst_rtt = 0, worst_skew = 0;
  std::string skew_pair;
  for (const RankReport& r : reports)
    for (const PeerProbe& p : r.peers) {
      ++probes;
      auto it = by_rank.find(p.peer);
      const RankReport* to = it == by_rank.end() ? nullptr : it->second;
      if (!p.ok) {
        ++failed;
        add_problem(v, connect_problem(r, to, p), "");
        continue;
      }
      worst_rtt = std::max(worst_rtt, p.rtt_ms);
      if (to != nullptr && to->host_id != r.host_id && std::fabs(p.clock_offset_ms) > std::fabs(worst_skew)) {
        worst_skew = p.clock_offset_ms;
        skew_pair = fmt::format("rank {} on {} and rank {} on {}", r.rank, r.host, to->rank, to->host);
      }
    }
  if (failed == 0)
    v.lines.push_back(fmt::format("  connectivity: ok, {} probe(s), every rank reached every peer (slowest connect + "
                                  "round trip {:.2f} ms)",
                                  probes, worst_rtt));
  else
    v.lines.push_back(fmt::format("  connectivity: {} of {} probe(s) failed", failed, probes));
  if (hosts.size() <= 1) {
    v.lines.push_back("  clock skew: one host, nothing to compare");
  } else if (std::fabs(worst_skew) / 1000.0 > opts.clock_skew_warn_s) {
    add_warning(v, fmt::format("clocks differ by {:.1f} ms between {}", worst_skew, skew_pair),
                "run a time daemon (chrony, ntpd) on every host; cohort's deadlines do not care, but timelines of "
                "several hosts will not line up");
  } else {
    v.lines.push_back(fmt::format("  clock skew: ok, at most {:.2f} ms between hosts (+- half a round trip)",
                                  std::fabs(worst_skew)));
  }
  return v;
}

void judge_links(Verdict& v, const std::vector<LinkProbe>& links, const DoctorOptions& opts) {
  for (const LinkProbe& l : links) {
    std::string who = l.a >= 0 ? fmt::format("rank {} <-> rank {} over {}", l.a, l.b, l.transport)
                               : fmt::format("all ranks ({})", l.transport);
    if (!l.error.empty()) {
      add_problem(v, fmt::format("{} probe, {}: {}", l.what, who, l.error),
                  "the connection works but the transfer failed: see the error; COHORT_DEBUG=INFO shows the set-up");
      continue;
    }
    if (l.a >= 0)
      v.lines.push_back(fmt::format("  {}: {}: latency {:.1f} us, busbw {:.2f} GB/s ({} B messages), data {}", l.what,
                                    who, l.latency_us, l.busbw_gbps, opts.probe_bytes, l.data_ok ? "ok" : "WRONG"));
    else
      v.lines.push_back(fmt::format("  {}: {}: {} B in {:.1f} us, busbw {:.2f} GB/s, data {}", l.what, who,
                                    opts.probe_bytes, l.latency_us, l.busbw_gbps, l.data_ok ? "ok" : "WRONG"));
    if (!l.data_ok)
      add_problem(v, fmt::format("{} probe, {}: the data arrived wrong", l.what, who),
                  "bytes were corrupted in transit: a bug or broken hardware; report it with COHORT_DEBUG=TRACE output");
    if (opts.min_busbw_gbps > 0 && l.a >= 0 && l.busbw_gbps < opts.min_busbw_gbps)
      add_problem(v, fmt::format("{} link {} reached {:.2f} GB/s, below --min-busbw {:.2f} GB/s", l.what, who,
                                 l.busbw_gbps, opts.min_busbw_gbps),
                  l.transport == "tcp" ? "check that COHORT_SOCKET_IFNAME picks the fast interface, and the link's "
                                         "speed (ethtool); other jobs may share it"
                                       : "the host may be overloaded (other jobs, too many ranks per core)");
  }
}

}  // namespace cohort::launch
