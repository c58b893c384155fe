// A failure in the middle of training, survived by `cohort run --max-restarts`:
// one of 2 ranks SIGKILLs itself at a random step (the example's fault flag,
// first attempt only), the launcher restarts both ranks with
// TORCHELASTIC_RESTART_COUNT=1, the example resumes by itself from its newest
// valid checkpoint and finishes its 60 steps with the test accuracy of an
// uninterrupted run of the same recipe (--eval-at-stop).
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <random>
#include <regex>
#include <thread>

#include "launch_harness.hpp"
#include "test_deps.hpp"

namespace {

namespace lt = launch_test;
namespace fs = std::filesystem;

bool have_data() {
  return fs::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz");
}

// 60 steps of 2 x 256 images (half an epoch), a checkpoint every 10, then the test accuracy.
std::vector<std::string> job(const std::string& ckpt, std::vector<std::string> extra) {
  std::vector<std::string> a = {"run",
                                "--standalone",
                                "--nproc-per-node",
                                "2",
                                "--max-restarts",
                                "1",
                                COHORT_FASHION_MNIST_BIN,
                                "--epochs",
                                "1",
                                "--batch-size",
                                "256",
                                "--max-steps",
                                "60",
                                "--eval-at-stop",
                                "--warmup-steps",
                                "10",
                                "--checkpoint-dir",
                                ckpt,
                                "--checkpoint-every",
                                "10",
                                "--keep",
                                "2"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

std::string fmt_step(int step) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%09d", step);
  return buf;
}

double accuracy(const std::string& out) {
  std::smatch m;
  std::regex re(R"(RESULT ddp model=\S+ world=2 epoch=1 \S+ \S+ test_acc=([0-9.]+))");
  return std::regex_search(out, m, re) ? std::stod(m[1]) : -1;
}

TEST(ElasticRestart, KilledRankRestartsResumesAndReachesTheSameAccuracy) {
  if (!have_data()) COHORT_MISSING_DEP("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)");
  std::string base = lt::temp_dir();
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}};
  auto full = lt::run(job(base + "/a", {}), env, 600);
  ASSERT_EQ(full.status, 0) << full.err;
  const double want = accuracy(full.out);
  ASSERT_GT(want, 0.70) << full.out;  // the recipe learns (half an epoch)

  std::random_device rd;
  const int kill_step = 15 + static_cast<int>(rd() % 41);  // 15..55: after a checkpoint, before the end
  const int victim = static_cast<int>(rd() % 2);
  SCOPED_TRACE("rank " + std::to_string(victim) + " killed after step " + std::to_string(kill_step));
  auto r = lt::run(
      job(base + "/b", {"--fault-kill-rank", std::to_string(victim), "--fault-at-step", std::to_string(kill_step)}),
      env, 600);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("rank " + std::to_string(victim) + " (local " + std::to_string(victim) + ", pid "),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("was killed by signal 9 (SIGKILL)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("restarting the workers (restart 1 of 1)"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("auto-resume: restart 1"), std::string::npos) << r.out;
  const int ckpt_step = kill_step / 10 * 10;
  EXPECT_NE(r.out.find("resumed from " + base + "/b/step_" + fmt_step(ckpt_step)), std::string::npos) << r.out;
  EXPECT_NEAR(accuracy(r.out), want, 1e-4) << r.out;
  fs::remove_all(base);
}

}  // namespace

namespace {

// The newest committed checkpoint step in dir (step_XXXXXXXXX without a .tmp suffix), or -1.
int newest_step(const std::string& dir) {
  int best = -1;
  for (auto& e : fs::directory_iterator(dir)) {
    std::string name = e.path().filename().string();
    if (name.rfind("step_", 0) == 0 && name.find(".tmp") == std::string::npos)
      best = std::max(best, std::stoi(name.substr(5)));
  }
  return best;
}

TEST(ElasticRestart, LauncherKilledWhileCheckpointingLeavesTheLastCheckpointLoadable) {
  if (!have_data()) COHORT_MISSING_DEP("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)");
  std::string base = lt::temp_dir(), ckpt = base + "/k";
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}};
  // A checkpoint after every step, so the launcher's death often lands inside a save.
  std::vector<std::string> args = job(ckpt, {});
  for (size_t i = 0; i + 1 < args.size(); ++i)
    if (args[i] == "--checkpoint-every") args[i + 1] = "1";
  lt::Proc run(args, env);
  for (int i = 0; i < 6000 && (!fs::exists(ckpt) || newest_step(ckpt) < 3); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_GE(newest_step(ckpt), 3) << "no checkpoints appeared";
  std::random_device rd;
  std::this_thread::sleep_for(std::chrono::milliseconds(rd() % 400));
  kill(run.pid(), SIGKILL);  // the workers die with it (PR_SET_PDEATHSIG)
  auto killed = run.wait(60);
  EXPECT_EQ(killed.status, 128 + SIGKILL);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the workers' deaths settle
  const int last = newest_step(ckpt);
  ASSERT_GE(last, 3);
  bool torn = false;
  for (auto& e : fs::directory_iterator(ckpt))
    torn = torn || e.path().filename().string().find(".tmp") != std::string::npos;
  std::printf("launcher killed with step %d committed%s\n", last, torn ? " and a save in progress" : "");

  // The next run (a restart by hand here) picks the newest committed checkpoint and trains on.
  auto resumed = lt::run(job(ckpt, {"--resume"}), env, 600);
  ASSERT_EQ(resumed.status, 0) << resumed.err;
  EXPECT_NE(resumed.out.find("resumed from " + ckpt + "/step_" + fmt_step(last)), std::string::npos) << resumed.out;
  EXPECT_GT(accuracy(resumed.out), 0.70) << resumed.out;
  fs::remove_all(base);
}

}  // namespace

namespace {

// The issue's demand in full: the demo itself (10 epochs of the CNN recipe, 2
// ranks, a checkpoint per epoch) with one of its ranks killed at a random step
// restarts once and still reaches the demo's accuracy target, 91.6 % (an
// uninterrupted run: 91.80 %). About 2 minutes on 2 cores.
TEST(ElasticRestart, TheTenEpochDemoWithAKilledRankReachesItsAccuracyTarget) {
  if (!have_data()) COHORT_MISSING_DEP("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)");
  std::string base = lt::temp_dir();
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}};
  std::random_device rd;
  const int kill_step = 100 + static_cast<int>(rd() % 4400);  // of 4690 steps
  const int victim = static_cast<int>(rd() % 2);
  SCOPED_TRACE("rank " + std::to_string(victim) + " killed after step " + std::to_string(kill_step));
  auto r = lt::run({"run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", COHORT_FASHION_MNIST_BIN,
                    "--epochs", "10", "--checkpoint-dir", base + "/ckpt", "--fault-kill-rank", std::to_string(victim),
                    "--fault-at-step", std::to_string(kill_step)},
                   env, 1200);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("was killed by signal 9 (SIGKILL)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("restarting the workers (restart 1 of 1)"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("auto-resume: restart 1"), std::string::npos) << r.out;
  std::smatch m;
  const std::regex final_epoch(R"(RESULT ddp model=cnn world=2 epoch=10 \S+ \S+ test_acc=([0-9.]+))");
  ASSERT_TRUE(std::regex_search(r.out, m, final_epoch)) << r.out;
  const double acc = std::stod(m[1]);
  std::printf("10 epochs, rank %d killed at step %d, one restart: test accuracy %.2f%%\n", victim, kill_step,
              100 * acc);
  EXPECT_GE(acc, 0.916) << r.out;
  fs::remove_all(base);
}

}  // namespace
