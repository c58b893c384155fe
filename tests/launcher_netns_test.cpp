// `cohort run --rdzv-backend c10d` across "machines": network namespaces with
// their own network stacks, joined by a bridge (netns_util.hpp, 10.81.0.0/24).
// Machine 0 owns the --rdzv-endpoint address, so its launcher hosts the store;
// the others connect over the veth links. Needs root and iproute2; skips with
// the reason otherwise. Short heartbeat and grace periods via env; no test
// asserts on how long anything took (bench/fault_times.py measures that).
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <regex>

#include "launch_harness.hpp"
#include "netns_util.hpp"

namespace lt = launch_test;
namespace nt = netns_test;

namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

const std::vector<std::string> kEnv = {"COHORT_RDZV_TIMEOUT=60s", "COHORT_TERM_TIMEOUT=2s",
                                       "COHORT_HEARTBEAT_TIMEOUT=3s", "COHORT_RDZV_LAST_CALL=2s", "OMP_NUM_THREADS=1"};

// The node rank a launcher was given in `round`, from its "round K: this is node N of" line; -1 if none.
int node_rank_in(const std::string& err, int round) {
  std::smatch m;
  std::regex re("round " + std::to_string(round) + ": this is node ([0-9]+) of");
  return std::regex_search(err, m, re) ? std::stoi(m[1]) : -1;
}

class LauncherNetns : public ::testing::Test {
 protected:
  void make(int machines) {
    std::string why;
    if (!lab_.make(machines, &why)) GTEST_SKIP() << "launcher network-namespace tests skipped: " << why;
    dir_ = lt::temp_dir();
  }
  void TearDown() override {
    nodes_.clear();  // kills what is left before the namespaces go
    lab_.remove();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  // Starts `cohort run` on machine i; the endpoint is machine 0's address.
  nt::NsProc& start(int i, const std::string& nnodes, int nproc, const std::vector<std::string>& program,
                    const std::vector<std::string>& extra = {}) {
    std::vector<std::string> cmd = {COHORT_BIN,         "run",
                                    "--nnodes",         nnodes,
                                    "--nproc-per-node", std::to_string(nproc),
                                    "--rdzv-backend",   "c10d",
                                    "--rdzv-endpoint",  nt::Lab::addr(0) + ":29400",
                                    "--rdzv-id",        "netjob"};
    cmd.insert(cmd.end(), extra.begin(), extra.end());
    cmd.insert(cmd.end(), program.begin(), program.end());
    nodes_.push_back(std::make_unique<nt::NsProc>(lab_.name(i), cmd, kEnv, dir_ + "/m" + std::to_string(i)));
    return *nodes_.back();
  }

  nt::Lab lab_;
  std::string dir_;
  std::vector<std::unique_ptr<nt::NsProc>> nodes_;
};

// First attempt sleeps (until stopped), later ones print and exit 0.
std::vector<std::string> sleep_first_attempt() {
  return {"/bin/sh", "-c",
          "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then sleep 60; fi; "
          "echo \"R=$RANK W=$WORLD_SIZE RC=$TORCHELASTIC_RESTART_COUNT\""};
}

}  // namespace

TEST_F(LauncherNetns, DynamicRendezvousAcrossTwoMachinesWithDifferentNproc) {
  make(2);
  // Machine 1 starts first: its launcher waits for the store machine 0 hosts.
  const std::string prog =
      "echo \"R=$RANK L=$LOCAL_RANK W=$WORLD_SIZE LW=$LOCAL_WORLD_SIZE G=$GROUP_RANK GW=$GROUP_WORLD_SIZE "
      "M=$MASTER_ADDR S=$COHORT_STORE_ADDR:$COHORT_STORE_PORT\"; exec " +
      lt::prog("coll_worker") + " allreduce-loop 65536 5";
  auto& m1 = start(1, "2", 1, {"/bin/sh", "-c", prog});
  auto& m0 = start(0, "2", 2, {"/bin/sh", "-c", prog});
  int rc0 = m0.wait(120), rc1 = m1.wait(120);
  ASSERT_EQ(rc0, 0) << m0.out() << m0.err();
  ASSERT_EQ(rc1, 0) << m1.out() << m1.err();
  EXPECT_TRUE(contains(m0.err(), "(hosting the store)")) << m0.err();
  EXPECT_FALSE(contains(m1.err(), "(hosting the store)")) << m1.err();
  // Node ranks follow the join order, which is up to the network: read them back.
  const int g0 = node_rank_in(m0.err(), 0), g1 = node_rank_in(m1.err(), 0);
  ASSERT_TRUE((g0 == 0 && g1 == 1) || (g0 == 1 && g1 == 0)) << m0.err() << m1.err();
  const int base0 = g0 == 0 ? 0 : 1, base1 = g1 == 0 ? 0 : 2;
  for (int lr = 0; lr < 2; ++lr)
    EXPECT_TRUE(contains(m0.out(), "R=" + std::to_string(base0 + lr) + " L=" + std::to_string(lr) +
                                       " W=3 LW=2 G=" + std::to_string(g0) + " GW=2"))
        << m0.out();
  EXPECT_TRUE(contains(m1.out(), "R=" + std::to_string(base1) + " L=0 W=3 LW=1 G=" + std::to_string(g1) + " GW=2"))
      << m1.out();
  // Node rank 0 picks MASTER_ADDR: its own address on the link towards the endpoint.
  const std::string master = "M=" + nt::Lab::addr(g0 == 0 ? 0 : 1);
  EXPECT_TRUE(contains(m0.out(), master)) << m0.out();
  EXPECT_TRUE(contains(m1.out(), master)) << m1.out();
  EXPECT_TRUE(contains(m1.out(), "S=10.81.0.1:29400")) << m1.out();
}

TEST_F(LauncherNetns, CutLinkIsReportedAsALostNodeAndTheOthersContinue) {
  make(3);
  auto& m0 = start(0, "2:3", 1, sleep_first_attempt(), {"--max-restarts", "1"});
  auto& m1 = start(1, "2:3", 1, sleep_first_attempt(), {"--max-restarts", "1"});
  auto& m2 = start(2, "2:3", 1, sleep_first_attempt(), {"--max-restarts", "1"});
  ASSERT_TRUE(m0.wait_err("round 0: this is node") && m1.wait_err("round 0: this is node") &&
              m2.wait_err("round 0: this is node"))
      << m0.err() << m1.err() << m2.err();
  ASSERT_TRUE(contains(m0.err(), " of 3 ")) << m0.err();
  const int cut_rank = node_rank_in(m2.err(), 0);
  ASSERT_TRUE(lab_.cut(2));
  int rc0 = m0.wait(90), rc1 = m1.wait(90), rc2 = m2.wait(90);
  const std::string lost = "lost node " + std::to_string(cut_rank) + " (";
  for (auto* m : {&m0, &m1}) {
    EXPECT_TRUE(contains(m->err(), lost)) << m->err();
    EXPECT_TRUE(contains(m->err(), "no heartbeat for")) << m->err();
    EXPECT_TRUE(contains(m->err(), "2 node(s) left")) << m->err();
    EXPECT_TRUE(contains(m->err(), "restarting the workers (restart 1 of 1)")) << m->err();
    EXPECT_TRUE(contains(m->err(), "round 1: this is node")) << m->err();
    EXPECT_TRUE(contains(m->err(), " of 2 ")) << m->err();
    EXPECT_TRUE(contains(m->out(), "W=2 RC=1")) << m->out();
  }
  EXPECT_EQ(rc0, 0) << m0.err();
  EXPECT_EQ(rc1, 0) << m1.err();
  // The cut-off machine finds out through its own store calls.
  EXPECT_EQ(rc2, 1) << m2.err();
  EXPECT_TRUE(contains(m2.err(), "lost the launcher's store at 10.81.0.1:29400")) << m2.err();
}

TEST_F(LauncherNetns, KilledAgentLeavesTooFewNodesAndTheJobEndsSayingSo) {
  make(2);
  auto& m0 = start(0, "2:2", 1, sleep_first_attempt(), {"--max-restarts", "1"});
  auto& m1 = start(1, "2:2", 1, sleep_first_attempt(), {"--max-restarts", "1"});
  ASSERT_TRUE(m0.wait_err("round 0: this is node") && m1.wait_err("round 0: this is node")) << m0.err() << m1.err();
  kill(m1.pid(), SIGKILL);
  EXPECT_EQ(m1.wait(30), 128 + SIGKILL);
  int rc0 = m0.wait(90);
  EXPECT_EQ(rc0, 1) << m0.err();
  EXPECT_TRUE(contains(m0.err(), "no heartbeat for")) << m0.err();
  EXPECT_TRUE(contains(m0.err(), "1 node(s) left, but --nnodes 2:2 needs at least 2")) << m0.err();
  EXPECT_FALSE(contains(m0.err(), "restarting the workers")) << m0.err();
}

TEST_F(LauncherNetns, SigtermToOneLauncherStopsTheWholeJob) {
  make(2);
  auto& m0 = start(0, "2", 1, {"/bin/sh", "-c", "sleep 60"});
  auto& n1 = start(1, "2", 2, {"/bin/sh", "-c", "sleep 60"});
  ASSERT_TRUE(m0.wait_err("round 0: this is node") && n1.wait_err("round 0: this is node")) << m0.err() << n1.err();
  kill(n1.pid(), SIGTERM);
  int rc1 = n1.wait(60), rc0 = m0.wait(60);
  EXPECT_EQ(rc1, 128 + SIGTERM) << n1.err();
  EXPECT_TRUE(contains(n1.err(), "received SIGTERM; stopped 2 worker(s)")) << n1.err();
  EXPECT_EQ(rc0, 1) << m0.err();
  EXPECT_TRUE(contains(m0.err(), "was stopped by SIGTERM")) << m0.err();
  EXPECT_TRUE(contains(m0.err(), "stopped the 1 worker(s) on this node")) << m0.err();
  EXPECT_FALSE(contains(m0.err(), "restarting")) << m0.err();
}
