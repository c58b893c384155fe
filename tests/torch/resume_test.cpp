// The Fashion-MNIST example through `cohort run`: a rank killed mid-run, then
// --resume from the newest valid checkpoint, gives exactly the losses of an
// uninterrupted run for the steps after the checkpoint.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

#include <signal.h>

#include "launch_harness.hpp"
#include "example_output.hpp"
#include "test_deps.hpp"

namespace {

using cohort::testing::example_losses;

namespace lt = launch_test;
namespace fs = std::filesystem;

bool have_data() { return fs::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"); }

// A copy of checkpoint directory `dir` at `into` without its checkpoints
// after `step`: a run that stopped there, for a resume that must start at
// that step although `dir` went on (every run saves at its --max-steps stop).
std::string fork_at(const std::string& dir, int step, const std::string& into) {
  fs::create_directories(into);
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step_", 0) == 0 && std::stoi(name.substr(5)) > step) continue;
    fs::copy(e.path(), into + "/" + name, fs::copy_options::recursive);
  }
  return into;
}

std::vector<std::string> job(const std::string& ckpt, std::vector<std::string> extra, int max_steps = 70) {
  std::vector<std::string> a = {"run", "--standalone", "--nproc-per-node", "2", COHORT_FASHION_MNIST_BIN, "--epochs", "2",
                                "--max-steps", std::to_string(max_steps), "--checkpoint-dir", ckpt, "--checkpoint-every", "20", "--log-losses",
                                "--keep", "2"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// `flags` at 2 ranks for 50 steps into `dir`, rank 1 killed after step 27;
// then --resume: from the step-20 checkpoint, the losses of `want` (the run
// that was not killed) to 1e-6.
void expect_resumes_after_a_kill(const std::string& dir, std::vector<std::string> flags,
                                 const std::map<int, double>& want) {
  const std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), flags.begin(), flags.end());
    return extra;
  };
  auto killed = lt::run(job(dir, with({"--fault-kill-rank", "1", "--fault-at-step", "27"}), 50), env, 600);
  EXPECT_NE(killed.status, 0);
  auto resumed = lt::run(job(dir, with({"--resume"}), 50), env, 600);
  ASSERT_EQ(resumed.status, 0) << resumed.err;
  auto got = example_losses(resumed.out);
  ASSERT_FALSE(got.empty());
  EXPECT_EQ(got.begin()->first, 21) << "resume should continue after the step-20 checkpoint";
  for (auto& [step, v] : got) EXPECT_NEAR(v, want.at(step), 1e-6) << "step " << step;
}

// --resume from `dir`'s step-40 checkpoint with `flags` (to step 50), in a
// run whose --shard differs from the one that wrote it: rank 0 says `note`
// (how the state is converted), and the losses follow `want` to 1e-4 (the
// same sums in another order).
void expect_converted_resume(const std::string& dir, const std::vector<std::string>& flags, const std::string& note,
                             const std::map<int, double>& want) {
  const std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}};
  std::vector<std::string> extra = flags;
  extra.push_back("--resume");
  auto resumed = lt::run(job(dir, extra, 50), env, 600);
  ASSERT_EQ(resumed.status, 0) << resumed.err;
  EXPECT_NE(resumed.out.find(note), std::string::npos) << resumed.out;
  auto got = example_losses(resumed.out);
  ASSERT_FALSE(got.empty());
  EXPECT_EQ(got.begin()->first, 41) << resumed.out;
  for (auto& [step, v] : got) EXPECT_NEAR(v, want.at(step), 1e-4) << "step " << step;
}

TEST(Resume, KilledRunResumesWithIdenticalLosses) {
  if (!have_data()) COHORT_MISSING_DEP("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)");
  std::string base = lt::temp_dir();
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}};
  auto full = lt::run(job(base + "/a", {}), env, 600);
  ASSERT_EQ(full.status, 0) << full.err;
  auto want = example_losses(full.out);
  ASSERT_EQ(want.size(), 70u) << full.out;
  // --max-steps 70 stopped the run mid-epoch: it saved that step, and the
  // same command with --resume has nothing left to train.
  EXPECT_TRUE(fs::exists(base + "/a/step_000000070/manifest.json")) << full.out;
  auto again = lt::run(job(base + "/a", {"--resume"}), env, 600);
  ASSERT_EQ(again.status, 0) << again.err;
  EXPECT_NE(again.out.find("nothing to train: the run is at step 70 and --max-steps is 70"), std::string::npos)
      << again.out;
  EXPECT_TRUE(example_losses(again.out).empty()) << again.out;

  // Rank 1 dies right after step 47: the newest checkpoint is step 40.
  auto killed = lt::run(job(base + "/b", {"--fault-kill-rank", "1", "--fault-at-step", "47"}), env, 600);
  EXPECT_NE(killed.status, 0);
  EXPECT_NE(killed.err.find("rank 1"), std::string::npos) << killed.err;
  auto resumed = lt::run(job(base + "/b", {"--resume"}), env, 600);
  ASSERT_EQ(resumed.status, 0) << resumed.err;
  EXPECT_NE(resumed.out.find("resumed from"), std::string::npos) << resumed.out;
  auto got = example_losses(resumed.out);
  ASSERT_FALSE(got.empty());
  EXPECT_EQ(got.begin()->first, 41) << "resume should continue after the step-40 checkpoint";
  for (auto& [step, v] : got) EXPECT_NEAR(v, want.at(step), 1e-6) << "step " << step;
  // keep 2: only the two newest checkpoints remain.
  int dirs = 0;
  for (auto& e : fs::directory_iterator(base + "/b"))
    if (e.path().filename().string().rfind("step_", 0) == 0) ++dirs;
  EXPECT_EQ(dirs, 2);
  fs::remove_all(base);
}

// AdamW's state (step count for the bias corrections, both moments) goes
// into the checkpoint and comes back: the resumed losses match to the bit.
TEST(Resume, AdamWResumesWithIdenticalLosses) {
  if (!have_data()) COHORT_MISSING_DEP("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)");
  std::string base = lt::temp_dir();
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}};
  auto full = lt::run(job(base + "/a", {"--optimizer", "adamw"}, 50), env, 600);
  ASSERT_EQ(full.status, 0) << full.err;
  auto want = example_losses(full.out);
  ASSERT_EQ(want.size(), 50u) << full.out;
  auto killed = lt::run(job(base + "/b", {"--optimizer", "adamw", "--fault-kill-rank", "0", "--fault-at-step", "27"}, 50), env, 600);
  EXPECT_NE(killed.status, 0);
  auto resumed = lt::run(job(base + "/b", {"--optimizer", "adamw", "--resume"}, 50), env, 600);
  ASSERT_EQ(resumed.status, 0) << resumed.err;
  auto got = example_losses(resumed.out);
  ASSERT_FALSE(got.empty());
  EXPECT_EQ(got.begin()->first, 21) << "resume should continue after the step-20 checkpoint";
  for (auto& [step, v] : got) EXPECT_NEAR(v, want.at(step), 1e-6) << "step " << step;
  fs::remove_all(base);
}

// --shard zero2: each rank saves its part of the AdamW state into one
// checkpoint (save_checkpoint_sharded); a rank killed mid-run, then --resume,
// gives the uninterrupted run's losses. The same checkpoint resumes at one
// rank (resharded, --shard zero1) and without --shard (gathered).
TEST(Resume, ShardedAdamWResumesWithIdenticalLossesAndAtAnotherWorldSize) {
  if (!have_data()) COHORT_MISSING_DEP("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)");
  std::string base = lt::temp_dir();
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}};
  const std::vector<std::string> sharded{"--optimizer", "adamw", "--shard", "zero2"};
  auto full = lt::run(job(base + "/a", sharded, 50), env, 600);
  ASSERT_EQ(full.status, 0) << full.err;
  auto want = example_losses(full.out);
  ASSERT_EQ(want.size(), 50u) << full.out;
  ASSERT_TRUE(fs::exists(base + "/a/step_000000040/optimizer.rank1.safetensors"));
  expect_resumes_after_a_kill(base + "/b", sharded, want);

  std::vector<std::string> one =
      job(fork_at(base + "/b", 40, base + "/one"), {"--optimizer", "adamw", "--shard", "zero1", "--resume"}, 54);
  one[3] = "1";  // --nproc-per-node 1: the two ranks' state resharded into one
  auto alone = lt::run(one, env, 600);
  ASSERT_EQ(alone.status, 0) << alone.err;
  EXPECT_NE(alone.out.find("written by 2 ranks, this run has 1"), std::string::npos) << alone.out;
  // Without --shard: every rank's part gathered into LibTorch's AdamW; the
  // losses follow the sharded run's (DDP's allreduce against ZeRO's
  // reduce-scatter: the same sums, up to the order of additions).
  expect_converted_resume(fork_at(base + "/b", 40, base + "/ddp"), {"--optimizer", "adamw"},
                          "this run has --shard none: its optimizer state is gathered from every rank's part", want);
  fs::remove_all(base);
}

// --shard fsdp: every rank saves its shard of the model and of the AdamW
// state (no rank holds the whole model); a rank killed mid-run, then
// --resume, gives the uninterrupted run's losses; the same checkpoint
// resumes without FSDP (gathered) and reshards to one rank, and a DDP run's
// checkpoint resumes under FSDP.
TEST(Resume, FsdpResumesWithIdenticalLossesAndAtAnotherWorldSize) {
  if (!have_data()) COHORT_MISSING_DEP("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)");
  std::string base = lt::temp_dir();
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}};
  const std::vector<std::string> fsdp{"--optimizer", "adamw", "--shard", "fsdp"};
  auto full = lt::run(job(base + "/a", fsdp, 50), env, 600);
  ASSERT_EQ(full.status, 0) << full.err;
  auto want = example_losses(full.out);
  ASSERT_EQ(want.size(), 50u) << full.out;
  EXPECT_NE(full.out.find("RESULT memory model=cnn shard=fsdp world=2"), std::string::npos) << full.out;
  for (const char* file : {"model.rank0", "model.rank1", "optimizer.rank0", "optimizer.rank1"})
    EXPECT_TRUE(fs::exists(base + "/a/step_000000040/" + file + ".safetensors")) << file;
  EXPECT_FALSE(fs::exists(base + "/a/step_000000040/model.safetensors")) << "no rank writes the whole model";

  expect_resumes_after_a_kill(base + "/b", fsdp, want);

  // Without --shard (DDP): the model's and the optimizer's parts gathered from
  // every rank's file; the losses follow the FSDP run's (the same sums, up to
  // the order of additions).
  expect_converted_resume(
      fork_at(base + "/b", 40, base + "/ddp"), {"--optimizer", "adamw"},
      "this run has --shard none: its model and optimizer state are gathered from every rank's part", want);

  // And the other way: a DDP run's checkpoint cut into FSDP's shards.
  auto plain = lt::run(job(base + "/p", {"--optimizer", "adamw"}, 50), env, 600);
  ASSERT_EQ(plain.status, 0) << plain.err;
  expect_converted_resume(fork_at(base + "/p", 40, base + "/p40"), {"--optimizer", "adamw", "--shard", "fsdp"},
                          "its model and optimizer state are cut into this run's shards", example_losses(plain.out));

  std::vector<std::string> one =
      job(fork_at(base + "/b", 40, base + "/one"), {"--optimizer", "adamw", "--shard", "fsdp", "--resume"}, 54);
  one[3] = "1";  // --nproc-per-node 1: the two ranks' shards resharded into one
  auto alone = lt::run(one, env, 600);
  ASSERT_EQ(alone.status, 0) << alone.err;
  EXPECT_NE(alone.out.find("written by 2 ranks, this run has 1"), std::string::npos) << alone.out;
  EXPECT_EQ(example_losses(alone.out).begin()->first, 41) << "from the step-40 checkpoint: " << alone.out;
  fs::remove_all(base);
}

// --comm-hook powersgd: every rank saves the hook's state (iteration, Qs,
// its own error feedback) beside the model; a rank killed mid-run, then
// --resume, gives the uninterrupted run's losses. Without that state the
// resumed run would average plainly for --powersgd-start-iter steps again.
TEST(Resume, PowerSgdHookStateResumesWithIdenticalLosses) {
  if (!have_data()) COHORT_MISSING_DEP("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)");
  std::string base = lt::temp_dir();
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}};
  const std::vector<std::string> hook{"--comm-hook", "powersgd", "--powersgd-start-iter", "10"};
  auto full = lt::run(job(base + "/a", hook, 50), env, 600);
  ASSERT_EQ(full.status, 0) << full.err;
  auto want = example_losses(full.out);
  ASSERT_EQ(want.size(), 50u) << full.out;
  for (const char* file : {"model", "optimizer", "powersgd.rank0", "powersgd.rank1"})
    EXPECT_TRUE(fs::exists(base + "/a/step_000000040/" + file + ".safetensors")) << file;
  expect_resumes_after_a_kill(base + "/b", hook, want);
  fs::remove_all(base);
}

// SIGTERM to `cohort run` (a scheduler stopping the job): the launcher
// passes it on, the ranks agree on a step (cohort::StopSignal), save it and
// exit 128 + SIGTERM; --resume continues from that very step with the
// losses of a run that was never stopped.
TEST(Resume, ASigtermedJobSavesTheStepItStoppedAtAndResumesFromIt) {
  if (!have_data()) COHORT_MISSING_DEP("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)");
  std::string base = lt::temp_dir();
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}};
  auto full = lt::run(job(base + "/a", {}, 300), env, 600);
  ASSERT_EQ(full.status, 0) << full.err;
  const auto want = example_losses(full.out);
  ASSERT_EQ(want.size(), 300u) << full.out;

  // Time enough between SIGTERM and SIGKILL for a step and a save on a busy machine.
  std::map<std::string, std::string> slow_kill = env;
  slow_kill["COHORT_TERM_TIMEOUT"] = "30s";
  lt::Proc run(job(base + "/b", {}, 300), slow_kill);
  ASSERT_TRUE(lt::wait_for_file(base + "/b/step_000000040/manifest.json")) << "no step-40 checkpoint appeared";
  kill(run.pid(), SIGTERM);
  auto stopped = run.wait(120);
  EXPECT_EQ(stopped.status, 128 + SIGTERM) << stopped.out << stopped.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(stopped.out, m, std::regex(R"(stopped at step (\d+): SIGTERM reached the job)")))
      << stopped.out << stopped.err;
  const int at = std::stoi(m[1]);
  EXPECT_GE(at, 40);
  ASSERT_LT(at, 300) << "the run ended before the signal: no stop was tested";
  char name[32];
  std::snprintf(name, sizeof(name), "step_%09d", at);
  EXPECT_TRUE(fs::exists(base + "/b/" + name + "/manifest.json")) << name;

  auto resumed = lt::run(job(base + "/b", {"--resume"}, 300), env, 600);
  ASSERT_EQ(resumed.status, 0) << resumed.err;
  const auto got = example_losses(resumed.out);
  ASSERT_FALSE(got.empty()) << resumed.out;
  EXPECT_EQ(got.begin()->first, at + 1) << resumed.out;
  for (auto& [step, v] : got) EXPECT_NEAR(v, want.at(step), 1e-6) << "step " << step;
  fs::remove_all(base);
}

// SIGTERM to one rank alone, after the last step of an epoch: the ranks
// agree on it (StopSignal::agreed is a MAX over the group, so rank 0, never
// signalled, stops too), save the end-of-epoch checkpoint and exit 143; the
// launcher restarts the job, which resumes at the next epoch's start with
// the losses of a run that was never stopped.
TEST(Resume, ASigtermToOneRankAtAnEpochsEndStopsEveryRankAndTheRestartContinues) {
  if (!have_data()) COHORT_MISSING_DEP("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)");
  const std::string base = lt::temp_dir();
  const std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}};
  // 1280 images at 2 ranks x 64: 10 steps an epoch.
  auto short_job = [&](const std::string& ckpt, std::vector<std::string> extra) {
    std::vector<std::string> a = {"run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                                  COHORT_FASHION_MNIST_BIN, "--epochs", "3", "--train-limit", "1280",
                                  "--checkpoint-dir", ckpt, "--log-losses"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  auto full = lt::run(short_job(base + "/a", {}), env, 600);
  ASSERT_EQ(full.status, 0) << full.err;
  const auto want = example_losses(full.out);
  ASSERT_EQ(want.size(), 30u) << full.out;

  auto r = lt::run(short_job(base + "/b", {"--fault-kill-rank", "1", "--fault-at-step", "10", "--fault-signal", "TERM"}),
                   env, 600);
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("stopped at step 10: SIGTERM reached the job"), std::string::npos) << r.out;  // rank 0 prints it
  EXPECT_NE(r.out.find("resumed from " + base + "/b/step_000000010: epoch 1, step 10, sample 0 of the epoch"),
            std::string::npos) << r.out;
  const auto got = example_losses(r.out);
  ASSERT_EQ(got.size(), 30u) << r.out;
  for (auto& [step, v] : got) EXPECT_NEAR(v, want.at(step), 1e-6) << "step " << step;
  fs::remove_all(base);
}

TEST(Resume, CorruptNewestCheckpointFallsBackToTheOneBefore) {
  if (!have_data()) COHORT_MISSING_DEP("Fashion-MNIST not installed");
  std::string base = lt::temp_dir();
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}};
  auto first = lt::run(job(base + "/c", {}, 40), env, 600);
  ASSERT_EQ(first.status, 0) << first.err;
  // Flip a byte in the newest checkpoint's optimizer file: the manifest's
  // second file, which rank 1 checksums (find_latest_valid), so rank 0 learns
  // of the damage from rank 1 and both fall back.
  fs::path newest;
  for (auto& e : fs::directory_iterator(base + "/c"))
    if (e.path().filename().string().rfind("step_", 0) == 0 && e.path() > newest) newest = e.path();
  ASSERT_FALSE(newest.empty());
  {
    std::fstream f(newest / "optimizer.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-10, std::ios::end);
    f.put('\x5a');
  }
  auto resumed = lt::run(job(base + "/c", {"--resume"}, 45), env, 600);
  ASSERT_EQ(resumed.status, 0) << resumed.err;
  EXPECT_NE(resumed.out.find("resume: skipped " + newest.filename().string() + ": "), std::string::npos) << resumed.out;
  EXPECT_NE(resumed.out.find("optimizer.safetensors': its CRC32C is"), std::string::npos) << resumed.out;
  EXPECT_NE(resumed.out.find("step 20"), std::string::npos) << resumed.out;
  fs::remove_all(base);
}

}  // namespace

// A new job in a directory that holds an earlier run's checkpoints (with a
// higher step): after a restart it resumes its own checkpoint, not theirs.
TEST(Resume, ARestartResumesThisJobsCheckpointNotAnEarlierRunsHigherOne) {
  if (!have_data()) COHORT_MISSING_DEP("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)");
  std::string base = lt::temp_dir();
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}};
  ASSERT_EQ(lt::run(job(base + "/a", {}, 25), env, 600).status, 0);  // the earlier run: steps 20 and 25 saved
  std::vector<std::string> again = job(base + "/a", {"--fault-kill-rank", "1", "--fault-at-step", "6"}, 12);
  *(std::find(again.begin(), again.end(), "--checkpoint-every") + 1) = "4";
  again.insert(again.begin() + 1, {"--max-restarts", "1"});
  auto r = lt::run(again, env, 600);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("holds checkpoints of an earlier run (newest: step 25)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("written by another run"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("step_000000004: epoch 0, step 4"), std::string::npos) << r.out;
  fs::remove_all(base);
}

TEST(Resume, AnotherWorldSizeContinuesTheEpochWhereTheOldWorldStopped) {
  if (!have_data()) COHORT_MISSING_DEP("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)");
  std::string base = lt::temp_dir();
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}};
  ASSERT_EQ(lt::run(job(base + "/a", {}, 20), env, 600).status, 0);  // 2 ranks: checkpoint at step 20
  std::vector<std::string> one = job(base + "/a", {"--resume"}, 24);
  one[3] = "1";  // --nproc-per-node 1
  auto r = lt::run(one, env, 600);
  ASSERT_EQ(r.status, 0) << r.err;
  // 20 steps x 64 images x 2 ranks = 2560 samples of epoch 0 were trained: one rank continues after them.
  EXPECT_NE(r.out.find("written by 2 ranks, this run has 1: the epoch continues after its first 2560 samples"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("epoch 0, step 20, sample 2560 of the epoch"), std::string::npos) << r.out;
  fs::remove_all(base);
}

// What fixes the data order and the step count (batch size, seed, training
// samples), and the model and optimizer the state belongs to, must match the
// checkpoint's, or --resume is refused naming both values; a changed --lr,
// --momentum, ... only gets a note.
TEST(Resume, AChangedBatchSizeOrSeedIsRefusedNamingBoth) {
  if (!have_data()) COHORT_MISSING_DEP("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)");
  std::string base = lt::temp_dir();
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}};
  ASSERT_EQ(lt::run(job(base + "/a", {"--train-limit", "4096"}, 20), env, 600).status, 0);  // checkpoint at step 20
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--train-limit", "4096", "--batch-size", "32"},
       "it was written with --batch-size 64, this run has --batch-size 32, so the data order"},
      {{"--train-limit", "4096", "--seed", "7"}, "it was written with --seed 42, this run has --seed 7"},
      {{"--train-limit", "2048"}, "it was written with 4096 training samples, this run has 2048 training samples"},
      {{"--train-limit", "4096", "--model", "mlp"},
       "it was written with --model cnn, this run has --model mlp, so its weights do not fit this model"},
      {{"--train-limit", "4096", "--optimizer", "adamw"},
       "it was written with --optimizer sgd, this run has --optimizer adamw, so its optimizer state is another "
       "optimizer's"},
  };
  for (const auto& [extra, want] : cases) {
    std::vector<std::string> args = extra;
    args.push_back("--resume");
    auto r = lt::run(job(base + "/a", args, 25), env, 600);
    EXPECT_EQ(r.status, 1) << r.err;
    EXPECT_NE(r.err.find(want), std::string::npos) << r.err;
  }
  auto r = lt::run(job(base + "/a", {"--train-limit", "4096", "--lr", "0.05", "--momentum", "0.5", "--resume"}, 22), env,
                   600);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("written with --lr 0.03, this run has 0.05: the run continues with this run's learning-rate "
                       "schedule"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("written with --momentum 0.9, this run has 0.5: the run continues with this run's value"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("resumed from"), std::string::npos) << r.out;
  fs::remove_all(base);
}

namespace {

// A missing or truncated data file: the example's error names the file, what
// is wrong with it, and the flag that chose the directory.
TEST(ExampleData, AMissingOrTruncatedFileIsNamed) {
  if (!have_data()) COHORT_MISSING_DEP("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)");
  const std::string dir = lt::temp_dir();
  const std::string src = "/usr/share/datasets/fashion-mnist";
  const std::vector<std::string> args = {"run", "--standalone", "--nproc-per-node", "1", COHORT_FASHION_MNIST_BIN,
                                         "--data-dir", dir};
  auto r = lt::run(args, {}, 120);
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_NE(r.err.find("neither " + dir + "/train-images-idx3-ubyte.gz nor " + dir + "/train-images-idx3-ubyte exists"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("this program reads --data-dir, here " + dir), std::string::npos) << r.err;

  // All four present, the training labels cut short.
  for (const char* f : {"train-images-idx3-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"})
    fs::copy_file(src + "/" + f, dir + "/" + f);
  fs::copy_file(src + "/train-labels-idx1-ubyte.gz", dir + "/train-labels-idx1-ubyte.gz");
  fs::resize_file(dir + "/train-labels-idx1-ubyte.gz", fs::file_size(dir + "/train-labels-idx1-ubyte.gz") / 2);
  r = lt::run(args, {}, 120);
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_NE(r.err.find(dir + "/train-labels-idx1-ubyte.gz"), std::string::npos) << r.err;
  fs::remove_all(dir);
}

}  // namespace

namespace {

// --bf16-autocast (cohort::torch::Autocast around the forward) trains: the
// loss falls over a few steps on 2 ranks, as it does without it.
TEST(ExampleData, Bf16AutocastTrains) {
  if (!have_data()) COHORT_MISSING_DEP("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)");
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}};
  auto r = lt::run({"run", "--standalone", "--nproc-per-node", "2", COHORT_FASHION_MNIST_BIN, "--bf16-autocast",
                    "--max-steps", "60", "--train-limit", "8192", "--augment", "none", "--log-losses"},
                   env, 600);
  ASSERT_EQ(r.status, 0) << r.err;
  auto l = example_losses(r.out);
  ASSERT_EQ(l.size(), 60u) << r.out;
  double first = 0, last = 0;
  for (int s = 1; s <= 10; ++s) first += l.at(s) / 10;
  for (int s = 51; s <= 60; ++s) last += l.at(s) / 10;
  EXPECT_TRUE(std::isfinite(last));
  EXPECT_LT(last, first * 0.8) << "losses of steps 1-10 " << first << ", of steps 51-60 " << last;
}

}  // namespace

namespace {

// Around --resume: a --checkpoint-dir that is a file is refused before any
// training; a ZeRO checkpoint resumes under ZeRO with other bucket sizes
// (gathered and cut again) with the losses of the run that wrote it; and
// --resume over checkpoints that all fail their checks stops, changing
// nothing, instead of starting over beside them.
TEST(Resume, RefusalsAndABucketLayoutConversion) {
  if (!have_data()) COHORT_MISSING_DEP("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)");
  const std::string base = lt::temp_dir();
  const std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}};
  std::ofstream(base + "/afile") << "not a directory";
  auto r = lt::run(job(base + "/afile", {}, 5), env, 120);
  EXPECT_NE(r.status, 0);
  EXPECT_NE((r.out + r.err).find("exists and is not a directory"), std::string::npos) << r.out << r.err;

  const std::vector<std::string> zero2 = {"--optimizer", "adamw", "--shard", "zero2"};
  auto full = lt::run(job(base + "/z", zero2, 30), env, 600);
  ASSERT_EQ(full.status, 0) << full.err;
  const auto want = example_losses(full.out);  // from the step-20 checkpoint (the stop saved step 30 too)
  auto converted = lt::run(
      job(fork_at(base + "/z", 20, base + "/z20"), {"--optimizer", "adamw", "--shard", "zero1", "--first-bucket-mb", "0.05", "--resume"}, 30), env, 600);
  ASSERT_EQ(converted.status, 0) << converted.err;
  EXPECT_NE(converted.out.find("gathering its optimizer state and cutting it into this run's buckets"),
            std::string::npos) << converted.out;
  const auto got = example_losses(converted.out);
  ASSERT_FALSE(got.empty());
  EXPECT_EQ(got.begin()->first, 21) << converted.out;
  for (auto& [step, v] : got) EXPECT_NEAR(v, want.at(step), 1e-4) << "step " << step;

  std::vector<std::string> before;
  for (auto& e : fs::directory_iterator(base + "/z"))
    if (e.path().filename().string().rfind("step_", 0) == 0) {
      before.push_back(e.path().filename().string());
      for (auto& f : fs::directory_iterator(e.path()))
        if (f.path().extension() == ".safetensors") fs::resize_file(f.path(), 10);
    }
  ASSERT_FALSE(before.empty());
  auto refused = lt::run(job(base + "/z", {"--optimizer", "adamw", "--resume"}, 30), env, 600);
  EXPECT_NE(refused.status, 0) << refused.err;
  EXPECT_NE(refused.err.find("none of the " + std::to_string(before.size()) + " checkpoint(s)"), std::string::npos)
      << refused.err;
  std::vector<std::string> after;
  for (auto& e : fs::directory_iterator(base + "/z"))
    if (e.path().filename().string().rfind("step_", 0) == 0) after.push_back(e.path().filename().string());
  std::sort(before.begin(), before.end());
  std::sort(after.begin(), after.end());
  EXPECT_EQ(after, before);
  fs::remove_all(base);
}

}  // namespace
