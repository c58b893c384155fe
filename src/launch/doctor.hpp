// `cohort doctor`: is this job's machinery healthy? Run it as the workers of a
// job (`cohort run --nproc-per-node 2 cohort doctor`, any number of nodes, or
// under mpirun / srun), or let `cohort run --preflight` run it before the
// program. Every rank:
//
//   1. checks its environment: the launcher's variables agree with each other
//      (RANK = GROUP_RANK x LOCAL_WORLD_SIZE + LOCAL_RANK, ...), /dev/shm is
//      there, writable and not tiny, the interface TCP would use
//      (COHORT_SOCKET_IFNAME or the route to the store's host) is not loopback
//      when the job spans hosts;
//   2. opens a probe listener on that interface and publishes its address in
//      the store, then connects to every peer's listener with a deadline
//      (COHORT_DOCTOR_CONNECT_TIMEOUT) and asks for its wall clock: whether
//      the peer is reachable, the round trip, and the clock offset (+-rtt/2).
//      Nothing here can hang or throw halfway through a collective: a peer
//      that is unreachable is a finding, not an exception;
//   3. publishes its findings as one JSON report in the store.
//
// Rank 0 reads every report. When every rank reached every peer, all ranks
// build a process group (the real transports) and measure, per link class
// (same host: shm; other host: tcp), one pair's ping-pong latency and
// bandwidth with a check of every byte, then an allreduce over all ranks, also
// checked. Rank 0 prints the verdict (stdout) with a hint for each problem and
// publishes it; every rank exits 0 when healthy and 1 when not.
//
// Store keys live under "cohort-doctor/<restart count>/" so that they never
// meet the program's. The pure parts (judging reports, hints) are functions
// here so that tests can call them with made-up reports.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace cohort::launch {

struct DoctorOptions {
  double min_busbw_gbps = 0;          // every link class must reach this (GB/s, 1e9 bytes/s); 0: no threshold
  size_t probe_bytes = 4u << 20;      // bandwidth probes (per message) and the allreduce
  int iters = 5;                      // timed round trips per probe (after one warm-up)
  std::chrono::milliseconds timeout{60000};  // every store wait, the group's set-up and collectives
  double clock_skew_warn_s = 0.1;     // a warning (not unhealthy) above this offset between hosts
};

// One peer as one rank saw it.
struct PeerProbe {
  int peer = -1;
  std::string addr;       // the address the peer advertised ("" if it never did)
  bool ok = false;
  std::string error;      // why not: "Connection refused (errno 111)", "timed out after 5 s", ...
  double rtt_ms = 0;      // connect + one request/reply
  double clock_offset_ms = 0;  // peer's wall clock minus ours
};

// One rank's findings (published as JSON).
struct RankReport {
  int rank = -1;
  int world_size = 0;     // as this rank's launcher variables say
  std::string host;       // hostname
  std::string host_id;    // hostname + boot id + network namespace: ranks that share shm and a network stack
  std::string launcher;   // "cohort run", "torchrun", ...
  std::string interface;  // the address TCP would use
  std::string interface_name;  // "eth0 (10.0.0.1)", for people
  double shm_free_mib = -1;
  std::vector<std::string> env_problems;  // "problem|hint" each (see env_problem)
  std::vector<std::string> env_warnings;
  std::vector<PeerProbe> peers;
};

std::string report_to_json(const RankReport& r);
RankReport report_from_json(const std::string& text);  // throws InvalidArgument on malformed text

// One measured link class (or the allreduce), filled in phase 2.
struct LinkProbe {
  std::string what;        // "same host", "other host", "allreduce"
  int a = -1, b = -1;      // the pair (allreduce: -1)
  std::string transport;   // "shm", "tcp", "mixed"
  double latency_us = 0;
  double busbw_gbps = 0;
  bool data_ok = false;
  std::string error;       // the probe failed: why
};

struct Verdict {
  bool healthy = true;
  std::vector<std::string> lines;     // the report, one line each, problems and hints included
  int problems = 0;
  int warnings = 0;
};

// Judges phase 1 (environment, connectivity, clocks). `missing` lists ranks
// that did not report within the deadline.
Verdict judge_reports(const std::vector<RankReport>& reports, const std::vector<int>& missing, int world_size,
                      const DoctorOptions& opts);
// Adds phase 2's measurements to a verdict (thresholds from opts).
void judge_links(Verdict& v, const std::vector<LinkProbe>& links, const DoctorOptions& opts);

// "rank 1 on host b cannot reach rank 0 on host a at 10.0.0.1:29500: Connection refused (errno 111)" and a hint
// that fits the error (refused: firewall / wrong interface; timeout: routing, firewall dropping; ...).
std::string connect_problem(const RankReport& from, const RankReport* to, const PeerProbe& p);

// Runs the doctor in this process (a worker) and returns its exit code.
int run_doctor(const DoctorOptions& opts);

}  // namespace cohort::launch
