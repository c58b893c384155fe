// `cohort doctor` and `cohort run --preflight`: the verdict as a pure function
// of made-up reports, then real jobs through the cohort binary. A blocked port
// is made honestly with the COHORT_DOCTOR_FAULT test knob: one rank advertises
// a port it bound but does not listen on, so the other ranks' real connects
// are refused by the kernel.
#include <gtest/gtest.h>

#include <filesystem>

#include "cohort/error.hpp"
#include "launch/doctor.hpp"
#include "launch_harness.hpp"

namespace lt = launch_test;
namespace fs = std::filesystem;
using namespace cohort::launch;

namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

RankReport report(int rank, const std::string& host, int world) {
  RankReport r;
  r.rank = rank;
  r.world_size = world;
  r.host = host;
  r.host_id = host + "|boot|ns";
  r.launcher = "cohort run";
  r.interface = host == "a" ? "10.0.0.1" : "10.0.0.2";
  r.shm_free_mib = 1024;
  for (int p = 0; p < world; ++p)
    if (p != rank) r.peers.push_back(PeerProbe{p, p < 2 ? "10.0.0.1:4000" : "10.0.0.2:4000", true, "", 0.2, 0.5});
  return r;
}

std::string text(const Verdict& v) {
  std::string s;
  for (const auto& l : v.lines) s += l + "\n";
  return s;
}

}  // namespace

TEST(DoctorVerdict, HealthyJob) {
  std::vector<RankReport> rs{report(0, "a", 4), report(1, "a", 4), report(2, "b", 4), report(3, "b", 4)};
  Verdict v = judge_reports(rs, {}, 4, DoctorOptions{});
  EXPECT_TRUE(v.healthy) << text(v);
  EXPECT_EQ(v.problems, 0);
  EXPECT_TRUE(contains(text(v), "4 rank(s) on 2 host(s)")) << text(v);
  EXPECT_TRUE(contains(text(v), "every rank reached every peer")) << text(v);
}

TEST(DoctorVerdict, RefusedConnectionNamesBothRanksTheAddressAndAHint) {
  std::vector<RankReport> rs{report(0, "a", 4), report(1, "a", 4), report(2, "b", 4), report(3, "b", 4)};
  rs[3].peers[0].ok = false;  // rank 3 -> rank 0
  rs[3].peers[0].error = "Connection refused (errno 111)";
  Verdict v = judge_reports(rs, {}, 4, DoctorOptions{});
  EXPECT_FALSE(v.healthy);
  EXPECT_EQ(v.problems, 1);
  EXPECT_TRUE(contains(text(v), "rank 3 on host b cannot reach rank 0 on host a at 10.0.0.1:4000: Connection refused"))
      << text(v);
  EXPECT_TRUE(contains(text(v), "firewall")) << text(v);
  EXPECT_TRUE(contains(text(v), "COHORT_SOCKET_IFNAME")) << text(v);
}

TEST(DoctorVerdict, MissingRanksLoopbackAcrossHostsAndEnvProblems) {
  std::vector<RankReport> rs{report(0, "a", 3), report(1, "b", 3)};
  rs[1].interface = "127.0.0.1";
  rs[0].env_problems.push_back("/dev/shm is missing|mount a tmpfs there");
  Verdict v = judge_reports(rs, {2}, 3, DoctorOptions{});
  EXPECT_FALSE(v.healthy);
  EXPECT_EQ(v.problems, 3) << text(v);
  EXPECT_TRUE(contains(text(v), "rank 2 did not report")) << text(v);
  EXPECT_TRUE(contains(text(v), "rank 1 on host b would use the loopback address 127.0.0.1")) << text(v);
  EXPECT_TRUE(contains(text(v), "rank 0 on host a: /dev/shm is missing\n  HINT: mount a tmpfs there")) << text(v);
}

TEST(DoctorVerdict, RanksThatDisagreeOnTheWorldSize) {
  std::vector<RankReport> rs{report(0, "a", 2), report(1, "b", 2)};
  rs[1].world_size = 4;
  Verdict v = judge_reports(rs, {}, 2, DoctorOptions{});
  EXPECT_FALSE(v.healthy);
  EXPECT_TRUE(contains(text(v), "rank 1 on host b was told the world size is 4, rank 0 that it is 2")) << text(v);
}

TEST(DoctorVerdict, ClockSkewBetweenHostsIsAWarningOnly) {
  std::vector<RankReport> rs{report(0, "a", 2), report(1, "b", 2)};
  rs[1].peers[0].clock_offset_ms = -2500;
  Verdict v = judge_reports(rs, {}, 2, DoctorOptions{});
  EXPECT_TRUE(v.healthy) << text(v);
  EXPECT_EQ(v.warnings, 1);
  EXPECT_TRUE(contains(text(v), "clocks differ by -2500.0 ms between rank 1 on b and rank 0 on a")) << text(v);
}

TEST(DoctorVerdict, LinksBelowTheThresholdOrWithWrongDataAreProblems) {
  Verdict v;
  DoctorOptions o;
  o.min_busbw_gbps = 5;
  judge_links(v,
              {LinkProbe{"same host", 0, 1, "shm", 10, 8.0, true, ""}, LinkProbe{"other host", 0, 2, "tcp", 50, 1.2, true, ""},
               LinkProbe{"allreduce", -1, -1, "shm + tcp", 900, 1.0, false, ""}},
              o);
  EXPECT_FALSE(v.healthy);
  EXPECT_EQ(v.problems, 2) << text(v);
  EXPECT_TRUE(contains(text(v), "other host link rank 0 <-> rank 2 over tcp reached 1.20 GB/s, below --min-busbw 5.00"))
      << text(v);
  EXPECT_TRUE(contains(text(v), "allreduce probe, all ranks (shm + tcp): the data arrived wrong")) << text(v);
}

TEST(DoctorVerdict, ReportsSurviveJson) {
  RankReport r = report(1, "b", 3);
  r.env_warnings.push_back("w|h");
  r.peers[1].ok = false;
  r.peers[1].error = "connect timed out";
  RankReport back = report_from_json(report_to_json(r));
  EXPECT_EQ(back.rank, 1);
  EXPECT_EQ(back.host_id, r.host_id);
  EXPECT_EQ(back.env_warnings, r.env_warnings);
  ASSERT_EQ(back.peers.size(), 2u);
  EXPECT_EQ(back.peers[1].error, "connect timed out");
  EXPECT_FALSE(back.peers[1].ok);
  EXPECT_THROW(report_from_json("{\"rank\": 1}"), cohort::InvalidArgument);
}

// Real jobs. --bytes and --iters keep the probes short on a busy machine.
namespace {

std::vector<std::string> doctor_job(int n, std::vector<std::string> extra = {}) {
  std::vector<std::string> a{"run", "--standalone", "--nproc-per-node", std::to_string(n), COHORT_BIN, "doctor",
                             "--bytes", "256K", "--iters", "2", "--timeout", "60"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

}  // namespace

TEST(Doctor, HealthyTwoRankJob) {
  auto r = lt::run(doctor_job(2), {}, 180);
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "[rank0]: verdict: HEALTHY")) << r.out;
  EXPECT_TRUE(contains(r.out, "same host: rank 0 <-> rank 1 over shm")) << r.out;
  EXPECT_TRUE(contains(r.out, "allreduce: all ranks (shm)")) << r.out;
  EXPECT_TRUE(contains(r.out, "data ok")) << r.out;
  EXPECT_FALSE(contains(r.out, "PROBLEM")) << r.out;
}

TEST(Doctor, BlockedPortNamesTheRankAndTheHint) {
  // Rank 1 advertises a closed port: ranks 0 and 2 must fail to reach it.
  auto r = lt::run(doctor_job(3), {{"COHORT_DOCTOR_FAULT", "closed-port:1"}}, 180);
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "[rank0]: verdict: UNHEALTHY (2 problem(s)")) << r.out;
  for (int from : {0, 2}) {
    std::string want = "cannot reach rank 1 on host ";
    bool found = false;
    for (const auto& line : lt::lines_with(r.out, "[rank0]: PROBLEM: rank " + std::to_string(from) + " on host "))
      found = found || (contains(line, want) && contains(line, "Connection refused") && contains(line, "firewall") &&
                        contains(line, "COHORT_SOCKET_IFNAME"));
    EXPECT_TRUE(found) << "no problem line for rank " << from << ":\n" << r.out;
  }
  EXPECT_FALSE(contains(r.out, "PROBLEM: rank 1 on host")) << "rank 1's own probes worked:\n" << r.out;
}

TEST(Doctor, ThresholdAboveAnyLinkIsUnhealthy) {
  auto r = lt::run(doctor_job(2, {"--min-busbw", "100000"}), {}, 180);
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "below --min-busbw 100000.00 GB/s")) << r.out;
}

TEST(Preflight, RefusesToStartWhenAPortIsBlocked) {
  std::string dir = lt::temp_dir();
  std::string marker = dir + "/started";
  auto r = lt::run({"run", "--standalone", "--nproc-per-node", "2", "--preflight", "/bin/sh", "-c",
                    "touch " + marker},
                   {{"COHORT_DOCTOR_FAULT", "closed-port:0"}}, 180);
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "PROBLEM: rank 1 on host")) << r.out;
  EXPECT_TRUE(contains(r.err, "pre-flight check failed")) << r.err;
  EXPECT_TRUE(contains(r.err, "refusing to start /bin/sh")) << r.err;
  EXPECT_FALSE(fs::exists(marker)) << "the program ran although the pre-flight check failed";
  fs::remove_all(dir);
}

TEST(Preflight, StartsTheProgramWhenHealthy) {
  std::string dir = lt::temp_dir();
  std::string marker = dir + "/started";
  auto r = lt::run({"run", "--standalone", "--nproc-per-node", "2", "--preflight", "/bin/sh", "-c",
                    "touch " + marker + ".$RANK"},
                   {}, 180);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "verdict: HEALTHY")) << r.out;
  EXPECT_TRUE(contains(r.err, "pre-flight check passed")) << r.err;
  EXPECT_TRUE(fs::exists(marker + ".0") && fs::exists(marker + ".1")) << r.err;
  fs::remove_all(dir);
}

TEST(Preflight, RefusesBelowMinBusbw) {
  auto r = lt::run({"run", "--standalone", "--nproc-per-node", "2", "--preflight", "--min-busbw", "100000", "/bin/true"},
                   {}, 180);
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "below --min-busbw")) << r.out;
  EXPECT_TRUE(contains(r.err, "refusing to start /bin/true")) << r.err;
}
