// Node-aware collectives (docs/algorithms.md, "Across hosts"): the host
// layout and the tuner as pure functions, then the collective suite in real
// processes under `cohort run` with the ranks on several hosts: hosts named
// by COHORT_HOST_ID (TCP between them, shared memory inside), and network
// namespaces joined by veth links, whose byte counters show what crossed.
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>

#include "cohort/error.hpp"
#include "collectives/host_layout.hpp"
#include "collectives/tuner.hpp"
#include "launch_harness.hpp"
#include "netns_util.hpp"

namespace cohort {
namespace {

namespace lt = launch_test;
namespace nt = netns_test;
using namespace collectives;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(HostLayout, InterleavedRanksOnTwoHosts) {
  const std::vector<std::string> hosts = {"a", "b", "a", "b"};
  HostLayout l = host_layout(hosts, 2);
  EXPECT_EQ(l.hosts, 2);
  EXPECT_EQ(l.ranks_per_host, 2);
  EXPECT_EQ(l.local, (std::vector<int>{0, 2}));
  EXPECT_EQ(l.local_index, 1);
  EXPECT_EQ(l.host_index, 0);
  EXPECT_EQ(l.cross, (std::vector<int>{2, 3}));
  EXPECT_EQ(hierarchical_unavailable(l), "");
  HostLayout l1 = host_layout(hosts, 1);
  EXPECT_EQ(l1.host_index, 1);
  EXPECT_EQ(l1.local, (std::vector<int>{1, 3}));
  EXPECT_EQ(l1.cross, (std::vector<int>{0, 1}));
}

TEST(HostLayout, ThreeHostsInBlocks) {
  const std::vector<std::string> hosts = {"x", "x", "y", "y", "z", "z"};
  HostLayout l = host_layout(hosts, 5);
  EXPECT_EQ(l.hosts, 3);
  EXPECT_EQ(l.ranks_per_host, 2);
  EXPECT_EQ(l.local, (std::vector<int>{4, 5}));
  EXPECT_EQ(l.cross, (std::vector<int>{1, 3, 5}));
  EXPECT_EQ(l.host_index, 2);
}

TEST(HostLayout, WhyTheNodeAwarePathCannotRun) {
  HostLayout uneven = host_layout({"a", "a", "b"}, 2);
  EXPECT_EQ(uneven.ranks_per_host, 0);
  EXPECT_TRUE(uneven.cross.empty());
  EXPECT_TRUE(contains(hierarchical_unavailable(uneven), "do not have the same number of ranks")) << hierarchical_unavailable(uneven);
  EXPECT_TRUE(contains(hierarchical_unavailable(host_layout({"a", "a"}, 0)), "one host"));
  EXPECT_TRUE(contains(hierarchical_unavailable(host_layout({"a", "b", "c"}, 0)), "one rank per host"));
}

TEST(Tuner, HierarchicalAboveTheTcpLatencyThresholdOnSeveralHosts) {
  TunerInput in{Coll::Allreduce, 64 << 20, 4, false, false, 2, 2};
  EXPECT_EQ(choose(in), Algo::Hierarchical);
  in.bytes = 64 << 10;  // recursive doubling up to allreduce_rd_max_tcp
  EXPECT_EQ(choose(in), Algo::RecursiveDoubling);
  in.bytes = (64 << 10) + 4;
  EXPECT_EQ(choose(in), Algo::Hierarchical);
  in.ranks_per_host = 0;  // uneven hosts
  EXPECT_EQ(choose(in), Algo::Ring);
  in.ranks_per_host = 1;
  EXPECT_EQ(choose(in), Algo::Ring);
  in = TunerInput{Coll::Allreduce, 64 << 20, 4, false, false, 2, 2};
  Thresholds off;
  off.hierarchical = false;
  EXPECT_EQ(choose(in, off), Algo::Ring);
  EXPECT_EQ(choose(TunerInput{Coll::Allreduce, 64 << 20, 4, true, true, 1, 4}), Algo::SingleCopy);  // one host
}

TEST(Tuner, HierarchicalWhereTheFlatChoiceIsARingOrChain) {
  auto pick = [](Coll c, size_t bytes, int hosts, int per_host) {
    return choose(TunerInput{c, bytes, hosts * per_host, false, false, hosts, per_host});
  };
  EXPECT_EQ(pick(Coll::ReduceScatter, 64, 2, 2), Algo::Hierarchical);  // fewer steps at any size
  EXPECT_EQ(pick(Coll::ReduceScatter, 64 << 20, 2, 1), Algo::Ring);
  EXPECT_EQ(pick(Coll::Allgather, 32 << 10, 2, 2), Algo::Direct);  // one step: latency
  EXPECT_EQ(pick(Coll::Allgather, (32 << 10) + 8, 2, 2), Algo::Hierarchical);
  EXPECT_EQ(pick(Coll::Allgather, 8, 8, 2), Algo::Hierarchical);  // 16 ranks: no direct
  EXPECT_EQ(pick(Coll::Broadcast, 256 << 10, 2, 4), Algo::Binomial);
  EXPECT_EQ(pick(Coll::Broadcast, (256 << 10) + 4, 2, 4), Algo::Hierarchical);
  EXPECT_EQ(choose(TunerInput{Coll::Broadcast, 64 << 20, 5, false, false, 3, 0}), Algo::Pipeline);  // uneven hosts
  EXPECT_EQ(pick(Coll::Reduce, 64 << 20, 2, 2), Algo::Binomial);
  EXPECT_EQ(override_from_env(Coll::Allreduce, "allreduce=hierarchical"), Algo::Hierarchical);
  EXPECT_EQ(override_from_env(Coll::Broadcast, "hier"), Algo::Hierarchical);
  EXPECT_EQ(override_from_env(Coll::Reduce, "hierarchical"), std::nullopt);  // a bare name applies where it can
  EXPECT_THROW(override_from_env(Coll::Reduce, "reduce=hierarchical"), InvalidArgument);
}

// `cohort run --nproc-per-node nproc` of the suite worker; host_of is a shell
// expression of LOCAL_RANK naming each rank's host.
lt::Result run_suite(int nproc, const std::string& host_of, std::map<std::string, std::string> env,
                     const std::vector<std::string>& gtest_args = {}) {
  std::string cmd = "COHORT_HOST_ID=h$((" + host_of + ")) exec " + lt::prog("coll_suite_worker");
  for (const auto& a : gtest_args) cmd += " " + a;
  env.emplace("COHORT_TIMEOUT", "60s");
  return lt::run({"run", "--standalone", "--nproc-per-node", std::to_string(nproc), "/bin/sh", "-c", cmd}, env, 420);
}

TEST(HierarchicalSuite, TwoHostsOfTwoEveryCollectiveForcedAtEverySize) {
  auto r = run_suite(4, "LOCAL_RANK / 2", {{"COHORT_ALGO", "hierarchical"}});
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  // The sub-group of ranks 0 and 2 has one rank per host: it says so and runs flat.
  EXPECT_TRUE(contains(r.err, "COHORT_ALGO asks for hierarchical, but there is one rank per host")) << r.err;
}

TEST(HierarchicalSuite, InterleavedHostsAndThreeHostsOfTwoAndTwoHostsOfThree) {
  for (auto [nproc, host_of] : {std::pair{4, "LOCAL_RANK % 2"}, {6, "LOCAL_RANK / 2"}, {6, "LOCAL_RANK % 2"}}) {
    auto r = run_suite(nproc, host_of, {{"COHORT_ALGO", "hierarchical"}},
                       {"--gtest_filter=Suite.Allreduce*:Suite.AllgatherReduceScatter:Suite.BroadcastReduceEveryRoot"});
    EXPECT_EQ(r.status, 0) << nproc << " ranks, host " << host_of << "\n" << r.out << r.err;
  }
}

TEST(HierarchicalSuite, TheTunerPicksItWhereTheFlatChoiceIsARingOrChain) {
  auto r = run_suite(4, "LOCAL_RANK / 2", {{"COHORT_DEBUG", "TRACE"}, {"COHORT_DEBUG_SUBSYS", "COLL"}},
                     {"--gtest_filter=Suite.AllreduceLargeF32:Suite.AllreduceEveryDtypeAndOp:"
                      "Suite.AllgatherReduceScatter:Suite.BroadcastReduceEveryRoot"});
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  for (const char* coll : {"allreduce", "allgather", "reduce_scatter", "broadcast"})
    EXPECT_TRUE(std::regex_search(r.err, std::regex(std::string(coll) + " #[0-9]+ .* algo hierarchical")))
        << coll << "\n" << r.err.substr(0, 4000);
  EXPECT_TRUE(contains(r.err, "algo recursive_doubling")) << r.err.substr(0, 4000);
  EXPECT_FALSE(std::regex_search(r.err, std::regex(" algo (ring|pipeline)"))) << r.err.substr(0, 4000);
}

// Shared buffers (allocate_buffer) on every rank of a host: that host's phases load and store the
// peers' buffers directly. The allreduce check also runs with only even ranks' buffers shared (both
// hosts fall back to the slots) and with only the first host's (the hosts take different forms in one
// call); allgather and reduce_scatter run in place on shared buffers, as ZeRO and FSDP call them.
TEST(HierarchicalSuite, SharedBuffersRunEachHostsPhasesBySingleCopy) {
  auto r = run_suite(4, "LOCAL_RANK / 2",
                     {{"COHORT_DEBUG", "TRACE"}, {"COHORT_DEBUG_SUBSYS", "COLL"}, {"COHORT_ALGO", "hierarchical"}},
                     {"--gtest_filter=Suite.AllreduceSharedBuffers:Suite.AllgatherReduceScatter"});
  EXPECT_EQ(r.status, 0) << r.out << r.err.substr(0, 4000);
  for (const char* coll : {"allreduce", "allgather", "reduce_scatter"})
    EXPECT_TRUE(std::regex_search(r.err, std::regex(std::string(coll) + " #[0-9]+ .* algo hierarchical")))
        << coll << "\n" << r.err.substr(0, 4000);
  EXPECT_TRUE(contains(r.err, "shared buffers on this host: its phases by single copy")) << r.err.substr(0, 4000);
  EXPECT_TRUE(contains(r.err, "shared outputs on this host: its phase by single copy")) << r.err.substr(0, 4000);
  EXPECT_TRUE(contains(r.err, "shared inputs on this host: its phase by single copy")) << r.err.substr(0, 4000);
}

TEST(HierarchicalSuite, UnevenHostsRunFlatAndSaySo) {
  auto r = run_suite(3, "LOCAL_RANK / 2", {{"COHORT_ALGO", "hierarchical"}},
                     {"--gtest_filter=Suite.Allreduce*"});
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_TRUE(contains(r.err, "the 2 hosts do not have the same number of ranks")) << r.err;
}

// Bytes that left and entered machine 0 on its veth link (its eth0 counters).
uint64_t link_bytes(const nt::Lab& lab, int machine) {
  const std::string path = lt::temp_dir() + "/stats";
  std::system(("ip -n " + lab.name(machine) + " -s link show eth0 > " + path + " 2>&1").c_str());
  const std::string text = nt::slurp(path);
  // "RX:  bytes packets ..." then the numbers line; then "TX: ..." likewise.
  std::smatch m;
  std::regex re(R"(RX:[^\n]*\n\s*(\d+)[^\n]*\n\s*TX:[^\n]*\n\s*(\d+))");
  if (!std::regex_search(text, m, re)) return 0;
  return std::stoull(m[1]) + std::stoull(m[2]);
}

class HierarchicalNetns : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!lab_.make(2, &why)) GTEST_SKIP() << "network-namespace tests skipped: " << why;
    dir_ = lt::temp_dir();
  }
  void TearDown() override {
    lab_.remove();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  // `cohort run` of 2 ranks on each machine; returns both launchers' results (0 = exit code 0).
  std::string run_both(const std::string& program, const std::vector<std::string>& env, int port) {
    std::vector<std::unique_ptr<nt::NsProc>> nodes;
    for (int i = 0; i < 2; ++i) {
      std::vector<std::string> cmd = {COHORT_BIN, "run", "--nnodes", "2", "--node-rank", std::to_string(i),
                                      "--nproc-per-node", "2", "--master-addr", nt::Lab::addr(0),
                                      "--master-port", std::to_string(port), "/bin/sh", "-c", program};
      std::vector<std::string> e = env;
      e.push_back("COHORT_TIMEOUT=120s");
      e.push_back("OMP_NUM_THREADS=1");
      nodes.push_back(std::make_unique<nt::NsProc>(lab_.name(i), cmd, e, dir_ + "/m" + std::to_string(i)));
    }
    std::string failures;
    for (int i = 0; i < 2; ++i) {
      int rc = nodes[i]->wait(400);
      if (rc != 0)
        failures += "machine " + std::to_string(i) + " exit " + std::to_string(rc) + ":\n" + nodes[i]->out() +
                    nodes[i]->err() + "\n";
    }
    return failures;
  }
  nt::Lab lab_;
  std::string dir_;
};

TEST_F(HierarchicalNetns, SuitePassesAcrossTwoMachinesOfTwoRanks) {
  std::string f = run_both(lt::prog("coll_suite_worker"), {"COHORT_ALGO=hierarchical"}, 29611);
  EXPECT_EQ(f, "");
}

TEST_F(HierarchicalNetns, LargeAllreduceSendsAtMost070OfTheFlatRingsBytesOverTheLink) {
  const std::string prog = lt::prog("coll_worker") + " allreduce-loop 67108864 3";
  const uint64_t b0 = link_bytes(lab_, 0);
  ASSERT_EQ(run_both(prog, {"COHORT_ALGO=allreduce=ring"}, 29612), "");
  const uint64_t b1 = link_bytes(lab_, 0);
  ASSERT_EQ(run_both(prog, {}, 29613), "");
  const uint64_t b2 = link_bytes(lab_, 0);
  const double flat = double(b1 - b0), hier = double(b2 - b1);
  // 3 x 64 MiB: the flat ring sends 1.5 buffers each way per call, the node-aware one 1.
  EXPECT_GT(flat, 3 * 1.5 * 2 * (64 << 20) * 0.95);
  EXPECT_LE(hier, 0.70 * flat) << "flat " << flat << " B, hierarchical " << hier << " B";
  std::printf("bytes over machine 0's link for 3 x 64 MiB allreduces: flat ring %.0f, hierarchical %.0f (%.3fx)\n",
              flat, hier, hier / flat);
}

}  // namespace
}  // namespace cohort
