// `cohort bench -c 1` through `cohort run`: real processes, every collective,
// world sizes 1..8 (above 2 oversubscribed), both transports, every dtype and
// op for the reducing collectives. Asserts correctness only (#wrong == 0),
// never timing.
#include <gtest/gtest.h>

#include "launch_harness.hpp"

namespace {

namespace lt = launch_test;

bool contains(const std::string& s, const std::string& needle) { return s.find(needle) != std::string::npos; }

struct Case {
  std::string coll;
  int world;
  std::string transport;
  std::string dtype = "float";
  std::string op = "sum";
};

std::string name(const Case& c) {
  return c.coll + "_np" + std::to_string(c.world) + "_" + c.transport + "_" + c.dtype + "_" + c.op;
}

void PrintTo(const Case& c, std::ostream* os) { *os << name(c); }

class BenchCheck : public ::testing::TestWithParam<Case> {};

TEST_P(BenchCheck, ZeroWrong) {
  const Case& c = GetParam();
  // Sizes cross the recursive-doubling / ring and binomial / pipeline thresholds.
  // shm_single_copy: every allreduce by single copy; shm_shared: and the buffers from allocate_buffer (peers map
  // them), which reduce_scatter and allgather need for single copy; shm_forced: single copy by COHORT_ALGO, on
  // ordinary buffers (process_vm_readv).
  const bool single_copy =
      c.transport == "shm_single_copy" || c.transport == "shm_shared" || c.transport == "shm_forced";
  std::vector<std::string> args{"run", "--standalone", "--nproc-per-node", std::to_string(c.world), COHORT_BIN, "bench", c.coll,
                                "--sizes", "0,8,100,4K,300K,2M", "-n", "2", "-w", "1", "-c", "1", "-d", c.dtype, "-o", c.op};
  if (c.transport == "shm_shared") args.push_back("--shared-buffers");
  auto r = lt::run(args,
                   {{"COHORT_TRANSPORT", single_copy ? "shm" : c.transport},
                    {"COHORT_SINGLE_COPY_BYTES", single_copy ? "1" : ""},
                    {"COHORT_SINGLE_COPY_SHARED_BYTES", single_copy ? "1" : ""},
                    {"COHORT_ALGO", c.transport == "shm_forced" ? "single_copy" : ""},
                    {"COHORT_TIMEOUT", "60s"}},
                   240);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "# Out of bounds values : 0 OK")) << r.out << r.err;
  EXPECT_FALSE(contains(r.err, "ERROR")) << r.err;
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (std::string coll : {"allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall", "gather", "scatter",
                           "sendrecv"})
    for (int n : {1, 2, 3, 4, 5, 8})
      for (std::string t : {"shm", "tcp"}) {
        if (coll == "sendrecv" && n == 1) continue;
        v.push_back({coll, n, t});
      }
  for (std::string coll : {"allreduce", "reduce", "reduce_scatter"})
    for (std::string dt : {"float", "double", "half", "bf16", "int8", "uint8", "int32", "int64"})
      for (std::string op : {"sum", "prod", "min", "max", "avg"}) {
        if (dt == "float" && op == "sum") continue;  // above
        v.push_back({coll, coll == "allreduce" ? 8 : 3, "shm", dt, op});
      }
  // Every allreduce by single copy, in real processes (other sizes than 8 ranks' blocks).
  for (int n : {2, 3, 5}) v.push_back({"allreduce", n, "shm_single_copy"});
  for (std::string dt : {"half", "int8", "double"})
    for (std::string op : {"avg", "max"}) v.push_back({"allreduce", 3, "shm_single_copy", dt, op});
  // The same with shared buffers: loads and stores straight into the peers' mapped buffers.
  for (int n : {2, 3, 5}) v.push_back({"allreduce", n, "shm_shared"});
  for (std::string dt : {"half", "int8", "double"})
    for (std::string op : {"avg", "max"}) v.push_back({"allreduce", 3, "shm_shared", dt, op});
  v.push_back({"broadcast", 3, "shm_shared"});
  // reduce_scatter and allgather by single copy: on shared buffers (the default's way) and forced on ordinary ones.
  for (std::string t : {"shm_shared", "shm_forced"})
    for (std::string coll : {"allgather", "reduce_scatter"})
      for (int n : {2, 3, 5}) v.push_back({coll, n, t});
  for (std::string dt : {"half", "bf16", "int32"})
    for (std::string op : {"avg", "min"}) v.push_back({"reduce_scatter", 3, "shm_shared", dt, op});
  return v;
}

INSTANTIATE_TEST_SUITE_P(All, BenchCheck, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return name(i.param); });

TEST(BenchFlags, BadInputIsRefusedClearly) {
  auto r = lt::run({"run", "--standalone", "--nproc-per-node", "1", COHORT_BIN, "bench", "allfoo"});
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(contains(r.err, "unknown collective 'allfoo'")) << r.err;
  r = lt::run({"run", "--standalone", "--nproc-per-node", "1", COHORT_BIN, "bench", "allreduce", "-d", "complex"});
  EXPECT_TRUE(contains(r.err, "-d complex: unknown dtype")) << r.err;
  r = lt::run({"run", "--standalone", "--nproc-per-node", "1", COHORT_BIN, "bench", "allreduce", "-b", "1M", "-e", "1K"});
  EXPECT_TRUE(contains(r.err, "need two byte sizes with -b <= -e")) << r.err;
  // -b 0 never grew by -f: the size list filled memory until something killed it.
  r = lt::run({"run", "--standalone", "--nproc-per-node", "1", COHORT_BIN, "bench", "allreduce", "-b", "0", "-e", "8"},
              {}, 60);
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(contains(r.err, "-b 0: the smallest size must be at least 1 byte")) << r.err;
  // A size past 2^64 is no size (it became 0).
  r = lt::run({"run", "--standalone", "--nproc-per-node", "1", COHORT_BIN, "bench", "allreduce", "--sizes",
               "99999999999999999999"});
  EXPECT_TRUE(contains(r.err, "is not a byte size")) << r.err;
  // Sizes under one element measured a collective of nothing: refused, or left out and said so.
  r = lt::run({"run", "--standalone", "--nproc-per-node", "1", COHORT_BIN, "bench", "allreduce", "-b", "3", "-e", "3"},
              {}, 60);
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(contains(r.err, "every size is under one element (4 bytes) per rank")) << r.err;
  r = lt::run({"run", "--standalone", "--nproc-per-node", "1", COHORT_BIN, "bench", "allreduce", "-b", "2", "-e", "8",
               "-n", "2", "-w", "1"},
              {}, 60);
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "1 size(s) under one f32 element per rank left out")) << r.out;
}

TEST(KillThroughLauncher, LauncherNamesTheKilledRankAndOthersNameItToo) {
  auto r = lt::run({"run", "--standalone", "--nproc-per-node", "3", lt::prog("coll_worker"), "kill-mid", "1",
                    std::to_string(16 << 20), "20"},
                   {{"COHORT_TIMEOUT", "120s"}}, 90);
  EXPECT_NE(r.status, 0);
  EXPECT_LT(r.seconds, 60) << "nobody should wait for the 120 s timeout";
  EXPECT_TRUE(contains(r.err, "rank 1 (local 1, pid ")) << r.err;
  EXPECT_TRUE(contains(r.err, "SIGKILL")) << r.err;
}

}  // namespace

namespace {

// Two launchers play two nodes (static rendezvous through node 0's store);
// the 4 ranks run a checked allreduce across both.
TEST(TwoLaunchers, CollectivesSpanBothNodes) {
  for (std::string transport : {"", "tcp"}) {
    int port = lt::free_port_pair();
    ASSERT_GT(port, 0);
    auto args = [&](int node) {
      return std::vector<std::string>{"run", "--nnodes", "2", "--node-rank", std::to_string(node), "--nproc-per-node", "2",
                                      "--master-addr", "127.0.0.1", "--master-port", std::to_string(port), COHORT_BIN, "bench",
                                      "allreduce", "--sizes", "8,64K,3M", "-n", "2", "-w", "1", "-c", "1"};
    };
    std::map<std::string, std::string> env{{"COHORT_TRANSPORT", transport}, {"COHORT_RDZV_TIMEOUT", "60s"}};
    lt::Proc node1(args(1), env);
    lt::Proc node0(args(0), env);
    auto r0 = node0.wait(120), r1 = node1.wait(120);
    EXPECT_EQ(r0.status, 0) << r0.out << r0.err;
    EXPECT_EQ(r1.status, 0) << r1.err;
    EXPECT_TRUE(contains(r0.out, "nranks 4")) << r0.out;
    EXPECT_TRUE(contains(r0.out, "# Out of bounds values : 0 OK")) << r0.out;
  }
}

}  // namespace
