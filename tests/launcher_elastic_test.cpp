// `cohort run --rdzv-backend c10d` with several launchers on 127.0.0.1:
// --nnodes MIN:MAX, a late node admitted at the next round, too few nodes,
// a worker failure restarting every node. The first launcher to bind the
// endpoint hosts the store. Short last-call and grace periods via env; no
// assertion on timing.
#include <gtest/gtest.h>

#include <fstream>
#include <thread>
#include <tuple>
#include <utility>

#include "cohort/store.hpp"
#include "launch_harness.hpp"

namespace lt = launch_test;

namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::vector<std::string> node_args(const std::string& nnodes, int port, const std::string& id,
                                   std::vector<std::string> program, std::vector<std::string> extra = {}) {
  std::vector<std::string> a = {"run",
                                "--nnodes",
                                nnodes,
                                "--nproc-per-node",
                                "1",
                                "--rdzv-backend",
                                "c10d",
                                "--rdzv-endpoint",
                                "127.0.0.1:" + std::to_string(port),
                                "--rdzv-id",
                                id};
  a.insert(a.end(), extra.begin(), extra.end());
  a.insert(a.end(), program.begin(), program.end());
  return a;
}

const std::map<std::string, std::string> kQuick = {{"COHORT_RDZV_TIMEOUT", "60s"},
                                                   {"COHORT_TERM_TIMEOUT", "2s"},
                                                   {"COHORT_RDZV_LAST_CALL", "1s"},
                                                   {"COHORT_HEARTBEAT_TIMEOUT", "5s"}};

// Attempt 0 sleeps until stopped; later attempts print their ranks and exit 0.
const std::vector<std::string> kSleepFirst = {"/bin/sh", "-c",
                                              "echo \"R=$RANK W=$WORLD_SIZE RC=$TORCHELASTIC_RESTART_COUNT\"; "
                                              "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then exec sleep 60; fi"};

// Waits (bounded) until a file exists.
bool wait_file(const std::string& path, double timeout_s = 60) {
  for (int i = 0; i < timeout_s * 20; ++i) {
    if (std::filesystem::exists(path)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

}  // namespace

TEST(LauncherElastic, LateNodeIsAdmittedAtTheNextRound) {
  int port = lt::free_port_pair();
  ASSERT_GT(port, 0);
  const std::string dir = lt::temp_dir();
  std::vector<std::string> prog = kSleepFirst;
  prog[2] = "touch " + dir + "/started.$TORCHELASTIC_RESTART_COUNT; " + prog[2];
  lt::Proc first(node_args("1:2", port, "late", prog, {"--max-restarts", "1"}), kQuick);
  // Round 0 closes with one node after the last call; its worker is running.
  ASSERT_TRUE(wait_file(dir + "/started.0"));
  lt::Proc late(node_args("1:2", port, "late", prog, {"--max-restarts", "1"}), kQuick);
  auto rl = late.wait(90), rf = first.wait(90);
  EXPECT_EQ(rf.status, 0) << rf.err;
  EXPECT_EQ(rl.status, 0) << rl.err;
  EXPECT_TRUE(contains(rf.err, "round 0: this is node 0 of 1")) << rf.err;
  EXPECT_TRUE(contains(rf.err, "1 new node(s) waiting to join (running 1 of at most 2 nodes)")) << rf.err;
  EXPECT_TRUE(contains(rf.err, "restarting the workers (restart 1 of 1)")) << rf.err;
  EXPECT_TRUE(contains(rl.err, "this node waits to join round 1")) << rl.err;
  for (const auto* r : {&rf, &rl}) {
    EXPECT_TRUE(contains(r->err, "round 1: this is node")) << r->err;
    EXPECT_TRUE(contains(r->err, " of 2 ")) << r->err;
    EXPECT_TRUE(contains(r->out, "W=2 RC=1")) << r->out;
  }
  std::filesystem::remove_all(dir);
}

TEST(LauncherElastic, TooFewNodesSaysHowManyCameAndHowManyAreNeeded) {
  int port = lt::free_port_pair();
  ASSERT_GT(port, 0);
  auto env = kQuick;
  env["COHORT_RDZV_TIMEOUT"] = "2s";
  auto r = lt::run(node_args("2:3", port, "few", {"/bin/true"}), env, 60);
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_TRUE(contains(r.err, "only 1 node(s) joined round 0 within 2 s, but --nnodes 2:3 needs at least 2")) << r.err;
}

TEST(LauncherElastic, WorkerFailureRestartsEveryNodeWithTheNextRestartCount) {
  int port = lt::free_port_pair();
  ASSERT_GT(port, 0);
  // Rank 1 fails in round 0; every rank of round 1 succeeds.
  std::vector<std::string> prog = {"/bin/sh", "-c",
                                   "echo \"R=$RANK RC=$TORCHELASTIC_RESTART_COUNT\"; "
                                   "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then "
                                   "  if [ \"$RANK\" = 1 ]; then exit 3; fi; exec sleep 60; fi"};
  auto run_pair = [&](int p) {
    lt::Proc a(node_args("2", p, "fail", prog, {"--max-restarts", "2"}), kQuick);
    lt::Proc b(node_args("2", p, "fail", prog, {"--max-restarts", "2"}), kQuick);
    auto x = a.wait(90);
    return std::make_pair(x, b.wait(90));
  };
  auto [ra, rb] = run_pair(port);
  // Seen twice in full-suite runs, never alone: neither launcher could host the
  // store (its port taken between the pick and the bind), both then waited as
  // clients. One more try on other ports tells that apart from a real failure.
  if (ra.status != 0 && rb.status != 0 && contains(ra.err, "cannot reach the launcher's store") &&
      contains(rb.err, "cannot reach the launcher's store")) {
    port = lt::free_port_pair();
    std::tie(ra, rb) = run_pair(port);
  }
  EXPECT_EQ(ra.status, 0) << ra.err;
  EXPECT_EQ(rb.status, 0) << rb.err;
  const std::string all = ra.err + rb.err;
  EXPECT_TRUE(contains(all, "rank 1 (local 0, pid ")) << all;
  EXPECT_TRUE(contains(all,
                       "exited with code 3; stopped the other 0 worker(s) on this node; restarting the workers "
                       "(restart 1 of 2)"))
      << all;
  EXPECT_TRUE(contains(all, "stopped the 1 worker(s) on this node (node ")) << all;
  EXPECT_TRUE(contains(ra.out + rb.out, "RC=1")) << ra.out << rb.out;
  EXPECT_FALSE(contains(all, "restart 2 of 2")) << all;
}

TEST(LauncherElastic, AFailureWithoutRestartsEndsEveryNode) {
  int port = lt::free_port_pair();
  ASSERT_GT(port, 0);
  std::vector<std::string> prog = {"/bin/sh", "-c", "if [ \"$RANK\" = 0 ]; then exit 5; fi; exec sleep 60"};
  lt::Proc a(node_args("2", port, "norestart", prog), kQuick);
  lt::Proc b(node_args("2", port, "norestart", prog), kQuick);
  auto ra = a.wait(90), rb = b.wait(90);
  EXPECT_EQ(ra.status, 1) << ra.err;
  EXPECT_EQ(rb.status, 1) << rb.err;
  EXPECT_TRUE(contains(ra.err, "rank 0 (local 0, pid ")) << ra.err;
  EXPECT_TRUE(contains(rb.err, "rank 0 (local 0, pid ")) << rb.err;
  EXPECT_TRUE(contains(ra.err + rb.err, "exited with code 5")) << ra.err << rb.err;
}

TEST(LauncherElastic, ALateNodeWithoutRestartsLeftIsToldTheJobFinished) {
  int port = lt::free_port_pair();
  ASSERT_GT(port, 0);
  const std::string dir = lt::temp_dir();
  // The running job's one worker waits for the test's go, so the late node surely arrives while it runs.
  std::vector<std::string> prog = {"/bin/sh", "-c",
                                   "touch " + dir + "/started; while [ ! -f " + dir + "/go ]; do sleep 0.1; done"};
  lt::Proc first(node_args("1:2", port, "nolate", prog), kQuick);
  ASSERT_TRUE(wait_file(dir + "/started"));
  lt::Proc late(node_args("1:2", port, "nolate", prog), kQuick);
  // Wait until the late launcher has registered for round 1, then let the job finish.
  cohort::TcpStoreOptions so;
  so.port = static_cast<uint16_t>(port);
  so.timeout = std::chrono::seconds(30);
  cohort::TcpStore store(so);
  for (int i = 0; i < 600 && store.add("cohort/elastic/nolate/r1/count", 0) < 1; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_EQ(store.add("cohort/elastic/nolate/r1/count", 0), 1);
  std::ofstream(dir + "/go").put('\n');
  auto rf = first.wait(90), rl = late.wait(90);
  EXPECT_EQ(rf.status, 0) << rf.err;
  EXPECT_FALSE(contains(rf.err, "restarting")) << "no restarts left (--max-restarts 0): " << rf.err;
  EXPECT_EQ(rl.status, 1) << rl.err;
  EXPECT_TRUE(contains(rl.err, "this node waits to join round 1")) << rl.err;
  EXPECT_TRUE(contains(rl.err, "the job finished before this launcher could join it")) << rl.err;
  std::filesystem::remove_all(dir);
}
