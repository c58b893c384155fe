// `cohort doctor` on one rank: phase 1 (doctor_probe.cpp), the verdict
// (doctor_verdict.cpp), and phase 2, the measured probes over a real process
// group. See doctor.hpp for the flow.
#include "launch/doctor.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cohort/error.hpp"
#include "cohort/process_group.hpp"
#include "cohort/store.hpp"
#include "core/log.hpp"
#include "group/launch_env.hpp"
#include "group/native_group.hpp"
#include "launch/doctor_probe.hpp"

namespace cohort::launch {
namespace {

using Ms = std::chrono::milliseconds;
using json = nlohmann::json;

Ms left(core::Deadline d) { return Ms(std::max(1, d.remaining_ms())); }

// Polls a counter until it reaches `want` or the deadline passes.
bool wait_count(Store& store, const std::string& key, int64_t want, core::Deadline d) {
  while (!d.passed()) {
    if (store.add(key, 0) >= want) return true;
    std::this_thread::sleep_for(Ms(20));
  }
  return false;
}

// The median of the timed rounds: one preempted round on a busy host does not
// decide the number.
double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// Bytes of the probe messages: a pattern that depends on the sender and the
// round, so a stale or misrouted message is caught too.
uint8_t pattern(int sender, int round, size_t i) { return static_cast<uint8_t>(i * 131 + sender * 17 + round * 7 + 1); }

void fill(std::vector<uint8_t>& b, int sender, int round) {
  for (size_t i = 0; i < b.size(); ++i) b[i] = pattern(sender, round, i);
}
bool check(const std::vector<uint8_t>& b, int sender, int round) {
  for (size_t i = 0; i < b.size(); ++i)
    if (b[i] != pattern(sender, round, i)) return false;
  return true;
}

json link_json(const LinkProbe& l) {
  return {{"what", l.what}, {"a", l.a}, {"b", l.b}, {"transport", l.transport}, {"latency_us", l.latency_us},
          {"busbw_gbps", l.busbw_gbps}, {"data_ok", l.data_ok}, {"error", l.error}};
}
LinkProbe link_from_json(const std::string& s) {
  json j = json::parse(s);
  return LinkProbe{j.at("what"), j.at("a"), j.at("b"), j.at("transport"), j.at("latency_us"), j.at("busbw_gbps"),
                   j.at("data_ok"), j.at("error")};
}

// One pair's ping-pong: `a` measures, `b` answers. Latency from 8-byte round
// trips, bandwidth from probe_bytes each way (busbw of a point-to-point link is
// its one-way rate), the median of o.iters rounds. Both sides check every
// byte, outside the timed part; b's check reaches a via the store.
void probe_pair(ProcessGroup& pg, Store& store, int key, LinkProbe l, const DoctorOptions& o) {
  const int me = pg.rank(), peer = me == l.a ? l.b : l.a;
  bool ok = true;
  try {
    // Filling and checking stay outside the timed part: only transfers are timed.
    std::vector<uint8_t> small_out(8), small_in(8), big_out(o.probe_bytes), big_in(o.probe_bytes);
    std::vector<double> rtts, bw_times;
    auto exchange = [&](std::vector<uint8_t>& out, std::vector<uint8_t>& in) {
      if (me == l.a) {
        pg.send(buffer(out), peer, SendRecvOptions{})->wait();
        pg.recv(buffer(in), peer, SendRecvOptions{})->wait();
      } else {
        pg.recv(buffer(in), peer, SendRecvOptions{})->wait();
        pg.send(buffer(out), peer, SendRecvOptions{})->wait();
      }
    };
    for (int round = 0; round <= o.iters; ++round) {  // round 0 warms up
      fill(small_out, me, round);
      fill(big_out, me, round);
      std::vector<uint8_t> sync_out(1), sync_in(1);
      exchange(sync_out, sync_in);  // untimed: both sides are done filling and checking
      auto t0 = core::Clock::now();
      exchange(small_out, small_in);
      auto t1 = core::Clock::now();
      exchange(big_out, big_in);
      auto t2 = core::Clock::now();
      ok = check(small_in, peer, round) && check(big_in, peer, round) && ok;
      if (round > 0) {
        rtts.push_back(std::chrono::duration<double>(t1 - t0).count());
        bw_times.push_back(std::chrono::duration<double>(t2 - t1).count());
      }
    }
    l.latency_us = median(rtts) / 2 * 1e6;
    const double bw_time = median(bw_times);
    l.busbw_gbps = bw_time > 0 ? 2.0 * static_cast<double>(o.probe_bytes) / bw_time / 1e9 : 0;
  } catch (const Error& e) {
    l.error = e.what();
  }
  if (me == l.b) {
    store.set_string(fmt::format("link/{}/b_ok", key), ok ? "1" : "0");
    return;
  }
  l.data_ok = ok;
  if (l.error.empty()) {
    try {
      l.data_ok = ok && store.get_string(fmt::format("link/{}/b_ok", key), o.timeout) == "1";
    } catch (const Error& e) {
      l.error = fmt::format("rank {} did not say whether its bytes were right: {}", l.b, e.what());
    }
  }
  store.set_string(fmt::format("link/{}", key), link_json(l).dump());
}

LinkProbe probe_allreduce(ProcessGroup& pg, const std::string& transports, const DoctorOptions& o) {
  LinkProbe l{"allreduce", -1, -1, transports};
  const int n = pg.size(), me = pg.rank();
  std::vector<float> v(std::max<size_t>(1, o.probe_bytes / sizeof(float)));
  int32_t wrong = 0;
  std::vector<double> times;
  for (int round = 0; round <= o.iters; ++round) {
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>((me + 1) * ((i + round) % 5));
    pg.barrier(BarrierOptions{})->wait();  // every rank is done filling: time the allreduce alone
    auto t0 = core::Clock::now();
    pg.allreduce(buffer(v), AllreduceOptions{})->wait();
    if (round > 0) times.push_back(core::seconds_since(t0));
    const float ranks = static_cast<float>(n * (n + 1) / 2);
    for (size_t i = 0; i < v.size(); ++i)
      if (v[i] != ranks * static_cast<float>((i + round) % 5)) ++wrong;
  }
  std::vector<int32_t> w{wrong};
  pg.allreduce(buffer(w), AllreduceOptions{.op = ReduceOp::Max})->wait();
  l.data_ok = w[0] == 0;
  const double t = median(times);
  const double algbw = t > 0 ? static_cast<double>(v.size() * sizeof(float)) / t / 1e9 : 0;
  l.busbw_gbps = algbw * 2.0 * (n - 1) / n;
  l.latency_us = t * 1e6;
  return l;
}

// Phase 2 on every rank. Rank 0 returns the measurements.
std::vector<LinkProbe> measure(const group::LaunchEnv& le, std::shared_ptr<Store> store,
                               const std::vector<RankReport>& reports, const DoctorOptions& o) {
  InitOptions io;
  io.rank = le.rank;
  io.world_size = le.world_size;
  io.store = std::make_shared<PrefixStore>("pg", store);
  io.timeout = o.timeout;
  auto pg = init_process_group(io);
  auto* native = dynamic_cast<group::NativeGroup*>(pg.get());
  auto transport = [&](int a, int b) -> std::string {
    if (native == nullptr) return "?";
    return native->transport_of(le.rank == a ? b : a);
  };

  // One pair per link class: the first host with two ranks, and rank 0 with
  // the first rank on another host.
  std::vector<LinkProbe> pairs;
  std::map<std::string, std::vector<int>> by_host;
  for (const RankReport& r : reports) by_host[r.host_id].push_back(r.rank);
  for (const RankReport& r : reports) {
    const auto& ranks = by_host[r.host_id];
    if (ranks.size() >= 2 && ranks[0] == r.rank) {
      pairs.push_back(LinkProbe{"same host", ranks[0], ranks[1]});
      break;
    }
  }
  for (const RankReport& r : reports)
    if (r.host_id != reports[0].host_id) {
      pairs.push_back(LinkProbe{"other host", 0, r.rank});
      break;
    }
  std::vector<LinkProbe> out;
  for (size_t k = 0; k < pairs.size(); ++k) {
    LinkProbe& l = pairs[k];
    if (le.rank == l.a || le.rank == l.b) {
      l.transport = transport(l.a, l.b);
      probe_pair(*pg, *store, static_cast<int>(k), l, o);
    }
    pg->barrier(BarrierOptions{})->wait();
  }
  // The allreduce's transports, as rank 0 reaches its peers.
  std::set<std::string> kinds;
  for (int p = 1; p < le.world_size; ++p) kinds.insert(native != nullptr ? native->transport_of(p) : "?");
  std::string mix = kinds.empty() ? "self" : fmt::format("{}", fmt::join(kinds, " + "));
  LinkProbe all = probe_allreduce(*pg, mix, o);
  pg->shutdown();
  if (le.rank != 0) return out;
  for (size_t k = 0; k < pairs.size(); ++k) out.push_back(link_from_json(store->get_string(fmt::format("link/{}", k), o.timeout)));
  out.push_back(all);
  return out;
}

std::string env_or(const char* name, const char* dflt) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : dflt;
}

}  // namespace

int run_doctor(const DoctorOptions& o) {
  group::LaunchEnv le;
  const group::EnvMap env = group::process_env();
  try {
    le = group::read_launch_env(env);
  } catch (const Error& e) {
    std::fprintf(stderr,
                 "cohort doctor: PROBLEM: the launcher's variables are not usable: %s\n"
                 "  HINT: run the doctor as the workers of a job, e.g. `cohort run --nproc-per-node 2 cohort doctor`\n",
                 e.what());
    return 1;
  }
  core::set_log_rank(le.rank);
  // The program's shared-memory segments and the doctor's must not meet.
  setenv("COHORT_RUN_ID", (env_or("COHORT_RUN_ID", "job") + "-doctor").c_str(), 1);
  std::shared_ptr<Store> store;
  try {
    TcpStoreOptions so;
    so.host = le.master_addr;
    so.port = static_cast<uint16_t>(le.master_port);
    so.is_server = !le.launcher_store && le.rank == 0;
    so.timeout = so.connect_timeout = o.timeout;
    auto base = std::make_shared<TcpStore>(so);
    store = std::make_shared<PrefixStore>("cohort-doctor/" + env_or("TORCHELASTIC_RESTART_COUNT", "0"), base);
    store->set_timeout(o.timeout);
  } catch (const Error& e) {
    std::fprintf(stderr,
                 "cohort doctor: PROBLEM: rank %d on host %s cannot reach the store at %s:%d (%s): %s\n"
                 "  HINT: is that host up and the port open? MASTER_ADDR must be an address every host can reach\n",
                 le.rank, doctor::hostname().c_str(), le.master_addr.c_str(), le.master_port,
                 le.master_addr_from.c_str(), e.what());
    return 1;
  }
  const auto deadline = core::Deadline::after(o.timeout);
  const int n = le.world_size, me = le.rank;
  bool healthy = false;
  try {
    // Phase 1: environment and connectivity.
    RankReport mine = doctor::check_environment(le, env);
    if (store->add(fmt::format("claim/{}", me), 1) > 1)  // only the later of two would-be rank-Rs sees this
      mine.env_problems.push_back(fmt::format("another process also started as rank {}|each rank must be started "
                                              "once: two launchers with the same --node-rank, or RANK set by hand?",
                                              me));
    std::unique_ptr<doctor::ProbeListener> listener;
    try {
      listener = std::make_unique<doctor::ProbeListener>(mine.interface, doctor::fault_closed_port(me));
    } catch (const Error& e) {  // a finding like any other: the other ranks still report theirs
      mine.env_problems.push_back(fmt::format("cannot open a probe listener: {}|set COHORT_SOCKET_IFNAME to an "
                                              "interface of this host that the others can reach",
                                              e.what()));
    }
    store->set_string(fmt::format("addr/{}", me), listener ? listener->advertised() : "");
    mine.peers = doctor::probe_peers(*store, me, n, deadline);
    store->set_string(fmt::format("report/{}", me), report_to_json(mine));
    store->add("probed", 1);
    wait_count(*store, "probed", n, deadline);  // keep answering until every rank has probed (or gave up)
    if (listener) listener->stop();

    std::vector<RankReport> reports;
    Verdict v;
    if (me == 0) {
      std::vector<int> missing;
      reports.push_back(mine);
      for (int r = 1; r < n; ++r) {
        try {
          reports.push_back(report_from_json(store->get_string(fmt::format("report/{}", r), left(deadline))));
        } catch (const TimeoutError&) {
          missing.push_back(r);
        }
      }
      v = judge_reports(reports, missing, n, o);
      store->set_string("phase1", v.healthy ? "ok" : "bad");
    }
    const bool phase2 = store->get_string("phase1", o.timeout) == "ok";
    if (phase2) {
      if (me != 0)  // phase 1 passed, so every report is there
        for (int r = 0; r < n; ++r) reports.push_back(report_from_json(store->get_string(fmt::format("report/{}", r))));
      std::vector<LinkProbe> links;
      try {
        links = measure(le, store, reports, o);
      } catch (const Error& e) {
        links.push_back(LinkProbe{"process group", -1, -1, "?", 0, 0, false, e.what()});
      }
      if (me == 0) judge_links(v, links, o);
    } else if (me == 0) {
      v.lines.push_back("  (not measuring latency and bandwidth: fix the problems above first)");
    }
    if (me == 0) {
      v.lines.push_back(v.healthy ? fmt::format("verdict: HEALTHY ({} warning(s))", v.warnings)
                                  : fmt::format("verdict: UNHEALTHY ({} problem(s), {} warning(s))", v.problems,
                                                v.warnings));
      for (const std::string& line : v.lines) std::printf("%s\n", line.c_str());
      std::fflush(stdout);
      store->set_string("verdict", v.healthy ? "healthy" : "unhealthy");
    }
    healthy = store->get_string("verdict", o.timeout) == "healthy";
  } catch (const TimeoutError& e) {
    std::fprintf(stderr, "cohort doctor: rank %d: no verdict: %s\n  HINT: rank 0 may have failed; look at its output\n",
                 me, e.what());
    return 1;
  } catch (const Error& e) {
    std::fprintf(stderr, "cohort doctor: rank %d on host %s: %s\n", me, doctor::hostname().c_str(), e.what());
    return 1;
  }
  // Rank 0 may serve the store (no launcher): it stays until every rank has read the verdict.
  try {
    store->add("done", 1);
    if (me == 0) wait_count(*store, "done", n, core::Deadline::after(std::chrono::seconds(10)));
  } catch (const Error&) {
  }
  if (!healthy && me != 0)
    std::fprintf(stderr, "cohort doctor: rank %d: the job is unhealthy (rank 0 printed why)\n", me);
  return healthy ? 0 : 1;
}

}  // namespace cohort::launch
