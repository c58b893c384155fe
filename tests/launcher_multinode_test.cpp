// `cohort run --nnodes 2`: two launchers on 127.0.0.1 play two nodes, meeting
// through the store node 0's launcher hosts on MASTER_PORT+1. Real processes,
// generous deadlines, short grace periods and rendezvous timeouts via env.
#include <gtest/gtest.h>

#include <signal.h>

#include <filesystem>
#include <set>

#include "launch_harness.hpp"

namespace lt = launch_test;
namespace fs = std::filesystem;

namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::vector<std::string> node_args(int nnodes, int node_rank, int port, int nproc, std::vector<std::string> program,
                                   std::vector<std::string> extra = {}) {
  std::vector<std::string> a = {"run", "--nnodes", std::to_string(nnodes), "--node_rank", std::to_string(node_rank),
                                "--nproc-per-node", std::to_string(nproc), "--master-addr", "127.0.0.1",
                                "--master-port", std::to_string(port)};
  a.insert(a.end(), extra.begin(), extra.end());
  a.insert(a.end(), program.begin(), program.end());
  return a;
}

const std::map<std::string, std::string> kQuick = {{"COHORT_RDZV_TIMEOUT", "30s"}, {"COHORT_TERM_TIMEOUT", "2s"}};

std::string value(const std::string& out, int rank, const std::string& key) {
  auto v = lt::lines_with(out, "[rank" + std::to_string(rank) + "]: " + key + "=");
  return v.size() == 1 ? v[0] : "<missing>";
}

TEST(LauncherMultiNode, TwoNodesGetGlobalRanks) {
  int port = lt::free_port_pair();
  ASSERT_GT(port, 0);
  // Node 1 first: its launcher must wait for node 0's store to appear.
  lt::Proc node1(node_args(2, 1, port, 2, {lt::prog("launch_env")}), kQuick);
  lt::Proc node0(node_args(2, 0, port, 2, {lt::prog("launch_env")}), kQuick);
  auto r0 = node0.wait(90), r1 = node1.wait(90);
  ASSERT_EQ(r0.status, 0) << r0.err;
  ASSERT_EQ(r1.status, 0) << r1.err;
  std::set<std::string> run_ids;
  for (int rank = 0; rank < 4; ++rank) {
    const std::string& out = rank < 2 ? r0.out : r1.out;
    EXPECT_EQ(value(out, rank, "RANK"), std::to_string(rank)) << out;
    EXPECT_EQ(value(out, rank, "LOCAL_RANK"), std::to_string(rank % 2));
    EXPECT_EQ(value(out, rank, "WORLD_SIZE"), "4");
    EXPECT_EQ(value(out, rank, "LOCAL_WORLD_SIZE"), "2");
    EXPECT_EQ(value(out, rank, "GROUP_RANK"), std::to_string(rank / 2));
    EXPECT_EQ(value(out, rank, "GROUP_WORLD_SIZE"), "2");
    EXPECT_EQ(value(out, rank, "ROLE_RANK"), std::to_string(rank));
    EXPECT_EQ(value(out, rank, "MASTER_PORT"), std::to_string(port));
    EXPECT_EQ(value(out, rank, "COHORT_STORE_ADDR"), "127.0.0.1");
    EXPECT_EQ(value(out, rank, "COHORT_STORE_PORT"), std::to_string(port + 1));
    run_ids.insert(value(out, rank, "COHORT_RUN_ID"));
  }
  EXPECT_EQ(run_ids.size(), 1u) << "both nodes share node 0's COHORT_RUN_ID";
}

TEST(LauncherMultiNode, FailureOnNode1StopsNode0) {
  int port = lt::free_port_pair();
  ASSERT_GT(port, 0);
  std::string dir = lt::temp_dir();
  std::vector<std::string> prog = {lt::prog("launch_behave"), "pid_dir=" + dir, "fail_rank=3", "code=3",
                                   "delay_ms=500", "sleep=120"};
  lt::Proc node0(node_args(2, 0, port, 2, prog), kQuick);
  lt::Proc node1(node_args(2, 1, port, 2, prog), kQuick);
  auto pids = lt::wait_pid_files(dir, 2);  // node 0's workers (ranks 0 and 1) are up
  auto r1 = node1.wait(90), r0 = node0.wait(90);
  EXPECT_EQ(r1.status, 1) << r1.err;
  EXPECT_EQ(r0.status, 1) << r0.err;
  EXPECT_LT(r0.seconds, 90);
  EXPECT_TRUE(contains(r1.err, "rank 3 (local 1, pid ")) << r1.err;
  EXPECT_TRUE(contains(r1.err, "on node 1 (")) << r1.err;
  EXPECT_TRUE(contains(r1.err, "exited with code 3; stopped the other 1 worker(s) on this node")) << r1.err;
  EXPECT_TRUE(contains(r0.err, "rank 3 (local 1, pid ")) << r0.err;
  EXPECT_TRUE(contains(r0.err, "on node 1 (")) << r0.err;
  EXPECT_TRUE(contains(r0.err, "stopped the 2 worker(s) on this node (node 0)")) << r0.err;
  ASSERT_EQ(pids.size(), 2u);
  for (pid_t pid : pids) EXPECT_TRUE(lt::wait_gone(pid));
  fs::remove_all(dir);
}

TEST(LauncherMultiNode, NodesRestartTogether) {
  int port = lt::free_port_pair();
  ASSERT_GT(port, 0);
  // Only rank 1 (node 1) fails, on attempt 0, a second after starting. Node 0's
  // worker has succeeded by then, yet node 0 must restart with node 1: the
  // restart is the whole job's.
  std::vector<std::string> prog = {lt::prog("launch_behave"), "fail_until_restart=1", "fail_rank=1", "delay_ms=1000"};
  lt::Proc node0(node_args(2, 0, port, 1, prog, {"--max-restarts", "1"}), kQuick);
  lt::Proc node1(node_args(2, 1, port, 1, prog, {"--max-restarts", "1"}), kQuick);
  auto r0 = node0.wait(90), r1 = node1.wait(90);
  EXPECT_EQ(r0.status, 0) << r0.err;
  EXPECT_EQ(r1.status, 0) << r1.err;
  EXPECT_TRUE(contains(r0.out, "[rank0]: restart 0")) << r0.out;
  EXPECT_TRUE(contains(r0.out, "[rank0]: restart 1")) << r0.out;
  EXPECT_TRUE(contains(r0.err, "the workers of this node had already finished; restarting the workers (restart 1 of 1)"))
      << r0.err;
  EXPECT_TRUE(contains(r1.out, "[rank1]: restart 1")) << r1.out;
}

TEST(LauncherMultiNode, SigtermToOneLauncherStopsTheOtherNode) {
  int port = lt::free_port_pair();
  ASSERT_GT(port, 0);
  std::string dir = lt::temp_dir();
  std::vector<std::string> prog = {lt::prog("launch_behave"), "pid_dir=" + dir, "sleep=120"};
  lt::Proc node0(node_args(2, 0, port, 1, prog, {"--max-restarts", "3"}), kQuick);
  lt::Proc node1(node_args(2, 1, port, 1, prog, {"--max-restarts", "3"}), kQuick);
  auto pids = lt::wait_pid_files(dir, 2);
  ASSERT_EQ(pids.size(), 2u);
  kill(node1.pid(), SIGTERM);
  auto r1 = node1.wait(90), r0 = node0.wait(90);
  EXPECT_EQ(r1.status, 128 + SIGTERM) << r1.err;
  EXPECT_EQ(r0.status, 1) << r0.err;
  EXPECT_TRUE(contains(r0.err, "the launcher of node 1 (")) << r0.err;
  EXPECT_TRUE(contains(r0.err, "was stopped by SIGTERM")) << r0.err;
  EXPECT_FALSE(contains(r0.err, "restarting")) << "a node that left cannot come back: " << r0.err;
  for (pid_t pid : pids) EXPECT_TRUE(lt::wait_gone(pid));
  fs::remove_all(dir);
}

TEST(LauncherMultiNode, MissingNodeTimesOutNamingIt) {
  int port = lt::free_port_pair();
  ASSERT_GT(port, 0);
  auto r = lt::run(node_args(3, 0, port, 1, {lt::prog("launch_env")}), {{"COHORT_RDZV_TIMEOUT", "1s"}});
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_TRUE(contains(r.err, "node(s) 1, 2 did not join within 1 s")) << r.err;
}

TEST(LauncherMultiNode, DuplicateNodeRankIsRefused) {
  int port = lt::free_port_pair();
  ASSERT_GT(port, 0);
  // Three nodes expected, node rank 1 started twice: one of the two is refused
  // at once; the others time out waiting for node 2.
  std::map<std::string, std::string> env = {{"COHORT_RDZV_TIMEOUT", "5s"}};
  lt::Proc node0(node_args(3, 0, port, 1, {lt::prog("launch_env")}), env);
  lt::Proc a(node_args(3, 1, port, 1, {lt::prog("launch_env")}), env);
  lt::Proc b(node_args(3, 1, port, 1, {lt::prog("launch_env")}), env);
  auto ra = a.wait(60), rb = b.wait(60), r0 = node0.wait(60);
  EXPECT_EQ(ra.status, 1) << ra.err;
  EXPECT_EQ(rb.status, 1) << rb.err;
  EXPECT_EQ(r0.status, 1) << r0.err;
  const std::string both = ra.err + rb.err;
  EXPECT_TRUE(contains(both, "node rank 1 is already taken by the launcher on")) << both;
  EXPECT_TRUE(contains(r0.err, "node(s) 2 did not join")) << r0.err;
}

}  // namespace
