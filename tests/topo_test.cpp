// `cohort topo`: its counts agree with hwloc asked directly and with sysconf;
// the text names every count; a bad flag and an unloadable topology give clear
// errors; the relation matrix is right on made-up two-socket machines, both
// synthetic (HWLOC_SYNTHETIC, through the CLI) and hand-built (the pure functions).
#include <gtest/gtest.h>
#include <hwloc.h>
#include <unistd.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>

#include "proc_util.hpp"
#include "topo/topology.hpp"

namespace cohort {
namespace {

using nlohmann::json;

struct CliResult {
  int code = -1;
  std::string out, err;
};

CliResult run_cli(const std::vector<std::string>& args, const std::map<std::string, std::string>& env, const char* tag) {
  std::vector<std::string> argv{COHORT_BIN};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<testing::Proc> ps{
      testing::spawn(argv, env, std::string(COHORT_TEST_BIN_DIR) + "/topo_test_" + tag + "_" + std::to_string(getpid()))};
  EXPECT_TRUE(testing::wait_all(ps, std::chrono::seconds(60))) << "cohort topo did not finish in 60 s";
  CliResult r{ps[0].exit_code(), ps[0].out(), ps[0].err()};
  std::remove(ps[0].out_path.c_str());
  std::remove(ps[0].err_path.c_str());
  return r;
}

// hwloc asked directly, with I/O objects kept as `cohort topo` keeps them.
struct Hwloc {
  hwloc_topology_t t = nullptr;
  Hwloc() {
    EXPECT_EQ(hwloc_topology_init(&t), 0);
    hwloc_topology_set_io_types_filter(t, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
    EXPECT_EQ(hwloc_topology_load(t), 0);
  }
  ~Hwloc() { hwloc_topology_destroy(t); }
  int count(hwloc_obj_type_t type) const { return hwloc_get_nbobjs_by_type(t, type); }
};

std::string with_count(int n, const std::string& one, const std::string& many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

TEST(TopoCli, JsonCountsMatchHwlocAndSysconf) {
  CliResult r = run_cli({"topo", "--json"}, {}, "json");
  ASSERT_EQ(r.code, 0) << r.err;
  json j = json::parse(r.out);
  Hwloc h;
  const json& c = j.at("counts");
  EXPECT_EQ(c.at("packages").get<int>(), h.count(HWLOC_OBJ_PACKAGE));
  EXPECT_EQ(c.at("numa_nodes").get<int>(), h.count(HWLOC_OBJ_NUMANODE));
  EXPECT_EQ(c.at("cores").get<int>(), h.count(HWLOC_OBJ_CORE));
  EXPECT_EQ(c.at("pus").get<int>(), h.count(HWLOC_OBJ_PU));
  // hwloc drops CPUs that a cgroup cpuset forbids; sysconf does not. On hosts
  // (and containers) without such a limit, the two agree.
  EXPECT_EQ(c.at("pus").get<long>(), sysconf(_SC_NPROCESSORS_ONLN));
  EXPECT_GE(c.at("cores").get<int>(), 1);
  EXPECT_LE(c.at("cores").get<int>(), c.at("pus").get<int>());
  for (auto [name, type] : {std::pair{"L2", HWLOC_OBJ_L2CACHE}, std::pair{"L3", HWLOC_OBJ_L3CACHE}}) {
    if (h.count(type) > 0) {
      EXPECT_EQ(c.at("caches").at(name).get<int>(), h.count(type)) << name;
    }
  }

  // One entry per NUMA node, with its CPUs and memory.
  ASSERT_EQ(j.at("numa_nodes").size(), static_cast<size_t>(h.count(HWLOC_OBJ_NUMANODE)));
  for (const json& n : j.at("numa_nodes")) {
    EXPECT_FALSE(n.at("cpuset").get<std::string>().empty()) << n.dump();
    EXPECT_GT(n.at("memory_bytes").get<std::uint64_t>(), 0u) << n.dump();
  }

  // Every network OS device hwloc sees is named by some NIC.
  std::set<std::string> nic_names;
  for (const json& nic : j.at("nics"))
    for (const json& name : nic.at("names")) nic_names.insert(name.get<std::string>());
  for (hwloc_obj_t o = hwloc_get_next_osdev(h.t, nullptr); o; o = hwloc_get_next_osdev(h.t, o)) {
    if (o->attr->osdev.type == HWLOC_OBJ_OSDEV_NETWORK) {
      EXPECT_TRUE(nic_names.count(o->name)) << o->name;
    }
  }

  // The matrix is square over NUMA nodes + NICs + GPUs, X on the diagonal, symmetric.
  const json& m = j.at("matrix");
  size_t n = j.at("numa_nodes").size() + j.at("nics").size() + j.at("gpus").size();
  ASSERT_EQ(m.at("labels").size(), n);
  ASSERT_EQ(m.at("rows").size(), n);
  for (size_t a = 0; a < n; ++a) {
    ASSERT_EQ(m.at("rows")[a].size(), n);
    EXPECT_EQ(m.at("rows")[a][a], "X");
    for (size_t b = 0; b < n; ++b) EXPECT_EQ(m.at("rows")[a][b], m.at("rows")[b][a]) << a << "," << b;
  }
  // With one NUMA node nothing can be across packages from it.
  if (h.count(HWLOC_OBJ_NUMANODE) == 1) {
    for (size_t b = 1; b < n; ++b) EXPECT_NE(m.at("rows")[0][b], "SYS") << m.at("labels")[b];
  }
  for (const char* sym : {"X", "NODE", "PKG", "SYS", "?"}) EXPECT_TRUE(m.at("legend").contains(sym)) << sym;
}

TEST(TopoCli, TextNamesEveryCount) {
  CliResult r = run_cli({"topo"}, {}, "text");
  ASSERT_EQ(r.code, 0) << r.err;
  Hwloc h;
  for (const std::string& want :
       {with_count(h.count(HWLOC_OBJ_PACKAGE), "package", "packages"),
        with_count(h.count(HWLOC_OBJ_NUMANODE), "NUMA node", "NUMA nodes"),
        with_count(h.count(HWLOC_OBJ_CORE), "core", "cores"), with_count(h.count(HWLOC_OBJ_PU), "PU", "PUs")})
    EXPECT_NE(r.out.find(want), std::string::npos) << "missing '" << want << "' in:\n" << r.out;
  for (const char* want : {"Machine", "Package L#0", "NUMANode L#0", "Core L#0", "PU L#0", "NICs:", "GPUs:",
                           "Legend:", "NUMA"})
    EXPECT_NE(r.out.find(want), std::string::npos) << "missing '" << want << "' in:\n" << r.out;
}

TEST(TopoCli, BadFlagIsAnError) {
  CliResult r = run_cli({"topo", "--no-such-flag"}, {}, "badflag");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("--no-such-flag"), std::string::npos) << r.err;
}

TEST(TopoCli, UnloadableTopologyIsAClearError) {
  // Only the synthetic backend, with a description it cannot parse.
  CliResult r = run_cli({"topo"}, {{"HWLOC_COMPONENTS", "synthetic,stop"}, {"HWLOC_SYNTHETIC", "no such thing"}}, "broken");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.err.find("hwloc could not load the host topology"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("HINT: hwloc was told where to look by HWLOC_COMPONENTS='synthetic,stop', HWLOC_SYNTHETIC="),
            std::string::npos)
      << r.err;
}

TEST(TopoCli, SyntheticTwoSocketMachine) {
  // 2 packages x 2 NUMA nodes x 2 cores x 2 threads.
  CliResult r = run_cli({"topo", "--json"},
                  {{"HWLOC_COMPONENTS", "synthetic,stop"}, {"HWLOC_SYNTHETIC", "pack:2 numa:2 core:2 pu:2"}}, "synth");
  ASSERT_EQ(r.code, 0) << r.err;
  json j = json::parse(r.out);
  EXPECT_FALSE(j.at("host").at("this_system").get<bool>());
  EXPECT_EQ(j.at("counts").at("packages"), 2);
  EXPECT_EQ(j.at("counts").at("numa_nodes"), 4);
  EXPECT_EQ(j.at("counts").at("cores"), 8);
  EXPECT_EQ(j.at("counts").at("pus"), 16);
  const json& rows = j.at("matrix").at("rows");
  ASSERT_EQ(rows.size(), 4u);
  EXPECT_EQ(rows[0][1], "PKG");  // nodes 0 and 1 share package 0
  EXPECT_EQ(rows[0][2], "SYS");  // node 2 is on package 1
  EXPECT_EQ(rows[3][2], "PKG");
  EXPECT_EQ(j.at("numa_nodes")[2].at("cpuset"), "8-11");
}

// The pure functions, on hand-built localities.
topo::Locality loc(std::vector<int> numa, std::vector<int> pkgs) {
  return {.cpuset = numa.empty() ? "" : "0", .numa_nodes = std::move(numa), .packages = std::move(pkgs)};
}

TEST(TopoRelation, FromNearToFar) {
  using topo::Relation;
  EXPECT_EQ(topo::relate(loc({0}, {0}), loc({0}, {0})), Relation::SameNuma);
  EXPECT_EQ(topo::relate(loc({0}, {0}), loc({1}, {0})), Relation::SamePackage);
  EXPECT_EQ(topo::relate(loc({0, 1}, {0}), loc({1}, {0})), Relation::SamePackage);  // device on the package
  EXPECT_EQ(topo::relate(loc({0}, {0}), loc({2}, {1})), Relation::CrossPackage);
  EXPECT_EQ(topo::relate(loc({0, 2}, {0, 1}), loc({0}, {0})), Relation::CrossPackage);  // device on the machine
  EXPECT_EQ(topo::relate(loc({}, {}), loc({0}, {0})), Relation::Unknown);
}

TEST(TopoRelation, MatrixOrdersNumaThenNicsThenGpus) {
  topo::Topology t;
  t.numa_nodes = {{.logical = 0, .os = 0, .locality = loc({0}, {0})}, {.logical = 1, .os = 1, .locality = loc({1}, {1})}};
  t.nics = {{.names = {"eth0"}, .kinds = {"network"}, .locality = loc({1}, {1})}};
  t.gpus = {{.names = {"cuda0"}, .kinds = {"coproc"}, .locality = loc({}, {})}};
  topo::Matrix m = topo::relation_matrix(t);
  EXPECT_EQ(m.labels, (std::vector<std::string>{"NUMA0", "NUMA1", "NIC0", "GPU0"}));
  EXPECT_EQ(m.cells[0][2], topo::Relation::CrossPackage);
  EXPECT_EQ(m.cells[1][2], topo::Relation::SameNuma);
  EXPECT_EQ(m.cells[3][0], topo::Relation::Unknown);
  EXPECT_EQ(m.cells[2][2], topo::Relation::Self);
  std::string text = topo::render_text(t);
  EXPECT_NE(text.find("NIC0  eth0"), std::string::npos) << text;
  EXPECT_NE(text.find("GPU0  cuda0"), std::string::npos) << text;
}

TEST(TopoRelation, HumanBytes) {
  EXPECT_EQ(topo::human_bytes(0), "0 B");
  EXPECT_EQ(topo::human_bytes(32 * 1024), "32 KiB");
  EXPECT_EQ(topo::human_bytes(1536ull * 1024 * 1024), "1.5 GiB");
}

}  // namespace
}  // namespace cohort
