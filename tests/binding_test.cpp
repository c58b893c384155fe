// The CPU layout hwloc reads (topo::load_cpu_layout), the --bind plan as a
// pure function (launch/binding.hpp) on made-up machines, and `cohort run
// --bind` end to end: each worker's sched_getaffinity must match the binding
// asked for, and the core lists `cohort topo` prints.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "cohort/error.hpp"
#include "core/cpu_list.hpp"
#include "launch/binding.hpp"
#include "launch/options.hpp"
#include "launch_harness.hpp"
#include "scoped_env.hpp"

namespace lt = launch_test;
namespace fs = std::filesystem;
using cohort::core::CpuList;
using cohort::topo::CpuLayout;
using namespace cohort::launch;

namespace {

// 2 NUMA nodes x 2 cores x 2 hardware threads, Linux-style numbering:
// node0 = CPUs 0,1,4,5; node1 = 2,3,6,7; core k = {k, k+4}.
CpuLayout two_sockets() {
  CpuLayout l;
  l.online = {0, 1, 2, 3, 4, 5, 6, 7};
  l.numa = {{0, 1, 4, 5}, {2, 3, 6, 7}};
  l.numa_ids = {0, 1};
  l.cores = {{0, 4}, {1, 5}, {2, 6}, {3, 7}};
  return l;
}

using cohort::testing::ScopedEnv;  // hwloc reads HWLOC_SYNTHETIC when it loads

}  // namespace

TEST(CpuList, ParsesAndPrintsTheKernelFormat) {
  EXPECT_EQ(*cohort::core::parse_cpu_list("0-3,8,10-11\n"), (CpuList{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_EQ(*cohort::core::parse_cpu_list(""), CpuList{});
  EXPECT_EQ(*cohort::core::parse_cpu_list("5,1,1"), (CpuList{1, 5}));
  EXPECT_FALSE(cohort::core::parse_cpu_list("3-1"));
  EXPECT_FALSE(cohort::core::parse_cpu_list("a"));
  EXPECT_FALSE(cohort::core::parse_cpu_list("1,,2"));
  EXPECT_EQ(cohort::core::cpu_list_text({0, 1, 2, 5, 7, 8}), "0-2,5,7-8");
  EXPECT_EQ(cohort::core::cpu_list_text({}), "none");
}

TEST(CpuLayout, ReadsHwlocsMachine) {
  // hwloc's synthetic description: 2 NUMA nodes x 2 cores x 2 hardware threads,
  // numbered in order (node0 = CPUs 0-3, core k = {2k, 2k+1}).
  ScopedEnv synthetic("HWLOC_SYNTHETIC", "numa:2 core:2 pu:2");
  CpuLayout l = cohort::topo::load_cpu_layout();
  EXPECT_EQ(l.online, (CpuList{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(l.numa, (std::vector<CpuList>{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(l.numa_ids, (std::vector<int>{0, 1}));
  EXPECT_EQ(l.cores, (std::vector<CpuList>{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_NE(cohort::topo::render_cpu_layout(l).find("cores: 0-1 | 2-3 | 4-5 | 6-7"), std::string::npos)
      << cohort::topo::render_cpu_layout(l);
}

TEST(CpuLayout, ThisHostsLayoutCoversItsCpus) {
  CpuLayout l = cohort::topo::load_cpu_layout();
  ASSERT_FALSE(l.online.empty());
  ASSERT_FALSE(l.cores.empty());
  CpuList all;
  for (const auto& c : l.cores) all.insert(all.end(), c.begin(), c.end());
  std::sort(all.begin(), all.end());
  EXPECT_EQ(all, l.online) << "every CPU is in exactly one core";
}

TEST(CpuLayout, BindWithABrokenHwlocNamesItAndAutoStillRuns) {
  // hwloc falls back to the real machine on almost any bad setting, so the
  // failure comes from a reader that throws as load_topology's fail() does.
  auto broken = []() -> CpuLayout { throw cohort::IoError("hwloc could not load the host topology (test)"); };
  try {
    plan_binding_here(BindMode::Core, 2, broken);
    FAIL() << "--bind core ran without a CPU layout";
  } catch (const cohort::IoError& e) {
    EXPECT_NE(std::string(e.what()).find("--bind core needs this host's CPU layout"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--bind none"), std::string::npos) << e.what();
  }
  BindPlan a = plan_binding_here(BindMode::Auto, 2, broken);
  EXPECT_EQ(a.mode, BindMode::None);
  EXPECT_NE(describe_binding(BindMode::Auto, a).find("hwloc could not read the CPU layout"), std::string::npos);
}

TEST(BindPlan, NoneDoesNotPin) {
  EXPECT_TRUE(plan_binding(BindMode::None, 4, two_sockets(), two_sockets().online).cpus.empty());
}

TEST(BindPlan, NumaGivesNeighbouringRanksOneNode) {
  auto p = plan_binding(BindMode::Numa, 4, two_sockets(), two_sockets().online);
  ASSERT_EQ(p.cpus.size(), 4u);
  EXPECT_EQ(p.cpus[0], (CpuList{0, 1, 4, 5}));
  EXPECT_EQ(p.cpus[1], (CpuList{0, 1, 4, 5}));
  EXPECT_EQ(p.cpus[2], (CpuList{2, 3, 6, 7}));
  EXPECT_EQ(p.cpus[3], (CpuList{2, 3, 6, 7}));
  auto one = plan_binding(BindMode::Numa, 1, two_sockets(), two_sockets().online);
  EXPECT_EQ(one.cpus, (std::vector<CpuList>{{0, 1, 4, 5}}));
}

TEST(BindPlan, CoreGivesEachRankWholeCoresInNumaOrder) {
  auto p = plan_binding(BindMode::Core, 2, two_sockets(), two_sockets().online);
  EXPECT_EQ(p.cpus, (std::vector<CpuList>{{0, 1, 4, 5}, {2, 3, 6, 7}}));
  EXPECT_FALSE(p.oversubscribed);
  auto four = plan_binding(BindMode::Core, 4, two_sockets(), two_sockets().online);
  EXPECT_EQ(four.cpus, (std::vector<CpuList>{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  auto three = plan_binding(BindMode::Core, 3, two_sockets(), two_sockets().online);  // 4 cores: 1, 1, 2
  EXPECT_EQ(three.cpus, (std::vector<CpuList>{{0, 4}, {1, 5}, {2, 3, 6, 7}}));
}

TEST(BindPlan, MoreRanksThanCoresShareRoundRobin) {
  auto p = plan_binding(BindMode::Core, 6, two_sockets(), two_sockets().online);
  EXPECT_TRUE(p.oversubscribed);
  ASSERT_EQ(p.cpus.size(), 6u);
  EXPECT_EQ(p.cpus[4], (CpuList{0, 4}));
  EXPECT_NE(describe_binding(BindMode::Core, p).find("some share a core"), std::string::npos);
}

TEST(BindPlan, OnlyTheLaunchersCpusAreHandedOut) {
  // A cpuset of CPUs 2,3,6: node 0 is out, core {2,6} and half of core {3,7} remain.
  auto p = plan_binding(BindMode::Core, 2, two_sockets(), {2, 3, 6});
  EXPECT_EQ(p.cpus, (std::vector<CpuList>{{2, 6}, {3}}));
  auto n = plan_binding(BindMode::Numa, 2, two_sockets(), {2, 3, 6});
  EXPECT_EQ(n.cpus, (std::vector<CpuList>{{2, 3, 6}, {2, 3, 6}}));
  EXPECT_THROW(plan_binding(BindMode::Core, 2, two_sockets(), {42}), cohort::InvalidArgument);
  EXPECT_EQ(plan_binding(BindMode::Auto, 2, two_sockets(), {42}).mode, BindMode::None);  // auto never refuses
}

TEST(BindPlan, AutoPinsToCoresOnlyWhenEachRankCanHaveOne) {
  auto two = plan_binding(BindMode::Auto, 2, two_sockets(), two_sockets().online);
  EXPECT_EQ(two.mode, BindMode::Core);
  EXPECT_EQ(two.cpus, (std::vector<CpuList>{{0, 1, 4, 5}, {2, 3, 6, 7}}));
  EXPECT_NE(describe_binding(BindMode::Auto, two).find("--bind auto (core): local rank 0 -> CPUs 0-1,4-5"),
            std::string::npos);
  auto one = plan_binding(BindMode::Auto, 1, two_sockets(), two_sockets().online);
  EXPECT_EQ(one.mode, BindMode::None);
  EXPECT_TRUE(one.cpus.empty());
  auto five = plan_binding(BindMode::Auto, 5, two_sockets(), two_sockets().online);  // 4 cores
  EXPECT_EQ(five.mode, BindMode::None);
  EXPECT_TRUE(five.cpus.empty());
  EXPECT_NE(describe_binding(BindMode::Auto, five).find("--bind auto (none): workers are not pinned"),
            std::string::npos);
}

TEST(BindPlan, ParsesTheFlag) {
  EXPECT_EQ(parse_bind("auto"), BindMode::Auto);
  EXPECT_EQ(parse_bind("none"), BindMode::None);
  EXPECT_EQ(parse_bind("numa"), BindMode::Numa);
  EXPECT_EQ(parse_bind("core"), BindMode::Core);
  try {
    parse_bind("socket");
    FAIL() << "parse_bind accepted 'socket'";
  } catch (const cohort::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("--bind socket"), std::string::npos) << e.what();
  }
}

// End to end: what each worker's sched_getaffinity says.
namespace {

std::map<int, CpuList> affinities(const std::string& out, int n) {
  std::map<int, CpuList> m;
  for (int r = 0; r < n; ++r)
    for (const auto& v : lt::lines_with(out, "[rank" + std::to_string(r) + "]: AFFINITY="))
      m[r] = *cohort::core::parse_cpu_list(v == "none" ? "" : v);
  return m;
}

lt::Result run_bind(const std::string& mode, int n, std::map<std::string, std::string> env = {}) {
  return lt::run({"run", "--standalone", "--nproc-per-node", std::to_string(n), "--bind", mode,
                  lt::prog("affinity_worker")},
                 std::move(env));
}

}  // namespace

TEST(RunBind, NoneLeavesTheLaunchersAffinity) {
  auto r = run_bind("none", 2);
  ASSERT_EQ(r.status, 0) << r.err;
  auto a = affinities(r.out, 2);
  ASSERT_EQ(a.size(), 2u) << r.out;
  for (auto& [rank, cpus] : a) EXPECT_EQ(cpus, cohort::core::current_affinity()) << "rank " << rank;
}

TEST(RunBind, CorePinsEachRankToItsOwnCores) {
  const CpuList allowed = cohort::core::current_affinity();
  auto plan = plan_binding(BindMode::Core, 2, cohort::topo::load_cpu_layout(), allowed);
  if (plan.oversubscribed) GTEST_SKIP() << "this machine lets the test use fewer than 2 cores";
  auto r = run_bind("core", 2, {{"COHORT_DEBUG", "INFO"}, {"COHORT_DEBUG_SUBSYS", "LAUNCH"}});
  ASSERT_EQ(r.status, 0) << r.err;
  auto a = affinities(r.out, 2);
  ASSERT_EQ(a.size(), 2u) << r.out;
  // Each rank: non-empty, inside the launcher's CPUs, disjoint from the other.
  for (auto& [rank, cpus] : a) {
    EXPECT_FALSE(cpus.empty());
    EXPECT_TRUE(std::includes(allowed.begin(), allowed.end(), cpus.begin(), cpus.end())) << "rank " << rank;
  }
  CpuList both;
  std::set_intersection(a[0].begin(), a[0].end(), a[1].begin(), a[1].end(), std::back_inserter(both));
  EXPECT_TRUE(both.empty()) << "ranks 0 and 1 share CPUs " << cohort::core::cpu_list_text(both);
  EXPECT_EQ(a[0], plan.cpus[0]);
  EXPECT_EQ(a[1], plan.cpus[1]);
  EXPECT_NE(r.err.find("INFO LAUNCH: --bind core: local rank 0 -> CPUs " + cohort::core::cpu_list_text(plan.cpus[0])),
            std::string::npos)
      << r.err;
}

TEST(RunBind, AutoIsTheDefaultAndPinsTwoRanksWhenThereAreTwoCores) {
  auto plan = plan_binding(BindMode::Auto, 2, cohort::topo::load_cpu_layout(), cohort::core::current_affinity());
  auto r = lt::run({"run", "--standalone", "--nproc-per-node", "2", lt::prog("affinity_worker")});
  ASSERT_EQ(r.status, 0) << r.err;
  auto a = affinities(r.out, 2);
  ASSERT_EQ(a.size(), 2u) << r.out;
  for (int rank : {0, 1})
    EXPECT_EQ(a[rank], plan.mode == BindMode::Core ? plan.cpus[rank] : cohort::core::current_affinity());
}

TEST(RunBind, NumaPinsEachRankToTheCpusOfANode) {
  const CpuList allowed = cohort::core::current_affinity();
  const CpuLayout layout = cohort::topo::load_cpu_layout();
  auto r = run_bind("numa", 2);
  ASSERT_EQ(r.status, 0) << r.err;
  auto a = affinities(r.out, 2);
  ASSERT_EQ(a.size(), 2u) << r.out;
  for (auto& [rank, cpus] : a) {
    bool is_a_node = false;  // exactly one node's CPUs (as far as the launcher may use them)
    for (const CpuList& node : layout.numa) {
      CpuList usable;
      std::set_intersection(node.begin(), node.end(), allowed.begin(), allowed.end(), std::back_inserter(usable));
      is_a_node = is_a_node || (!usable.empty() && usable == cpus);
    }
    EXPECT_TRUE(is_a_node) << "rank " << rank << " runs on CPUs " << cohort::core::cpu_list_text(cpus);
  }
}

// One reader: `cohort topo` and `cohort run --bind` see the same cores. With
// one rank per usable core, each rank runs on exactly one core of topo's list.
TEST(RunBind, EachRankGetsOneCoreThatTopoLists) {
  auto topo = lt::run({"topo", "--json"});
  ASSERT_EQ(topo.status, 0) << topo.err;
  const auto layout = nlohmann::json::parse(topo.out).at("cpu_layout");
  const CpuList allowed = cohort::core::current_affinity();
  std::vector<CpuList> usable;  // topo's cores that this process may run on, whole
  for (const auto& c : layout.at("cores")) {
    CpuList cpus = *cohort::core::parse_cpu_list(c.get<std::string>());
    if (std::includes(allowed.begin(), allowed.end(), cpus.begin(), cpus.end())) usable.push_back(cpus);
  }
  if (usable.size() < 2) GTEST_SKIP() << "fewer than 2 whole cores usable here";
  const int n = static_cast<int>(std::min<size_t>(usable.size(), 4));
  auto r = run_bind("core", n);
  ASSERT_EQ(r.status, 0) << r.err;
  auto a = affinities(r.out, n);
  ASSERT_EQ(a.size(), static_cast<size_t>(n)) << r.out;
  if (usable.size() == static_cast<size_t>(n)) {
    for (auto& [rank, cpus] : a) {
      EXPECT_NE(std::find(usable.begin(), usable.end(), cpus), usable.end())
          << "rank " << rank << " runs on CPUs " << cohort::core::cpu_list_text(cpus) << ", not a core of `cohort topo`:\n"
          << layout.dump();
    }
  }
}

// A machine hwloc is told to see (2 NUMA nodes of 1 CPU each, which this
// host's CPUs 0 and 1 can stand for): `cohort topo` and `--bind numa` both
// see it, which only holds when they read the layout the same way.
TEST(RunBind, TopoAndBindSeeTheSameSyntheticMachine) {
  const CpuList allowed = cohort::core::current_affinity();
  if (!std::binary_search(allowed.begin(), allowed.end(), 0) || !std::binary_search(allowed.begin(), allowed.end(), 1))
    GTEST_SKIP() << "needs CPUs 0 and 1";
  const std::map<std::string, std::string> env{{"HWLOC_SYNTHETIC", "numa:2 core:1 pu:1"}};
  auto topo = lt::run({"topo", "--json"}, env);
  ASSERT_EQ(topo.status, 0) << topo.err;
  const auto layout = nlohmann::json::parse(topo.out).at("cpu_layout");
  EXPECT_EQ(layout.at("numa_nodes").dump(), R"([{"cpus":"0","os_index":0},{"cpus":"1","os_index":1}])");
  auto r = run_bind("numa", 2, env);
  ASSERT_EQ(r.status, 0) << r.err;
  auto a = affinities(r.out, 2);
  EXPECT_EQ(a[0], (CpuList{0}));
  EXPECT_EQ(a[1], (CpuList{1}));
}

TEST(RunFlags, MinBusbwNeedsPreflight) {
  LaunchOptions o;
  o.command = {"/bin/true"};
  o.min_busbw = 5;
  EXPECT_THROW(validate(o), cohort::InvalidArgument);
  o.preflight = true;
  EXPECT_NO_THROW(validate(o));
  o.bind = "socket";
  EXPECT_THROW(validate(o), cohort::InvalidArgument);
}

TEST(RunBind, RejectsAnUnknownMode) {
  auto r = run_bind("socket", 1);
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("--bind socket"), std::string::npos) << r.err;
}
