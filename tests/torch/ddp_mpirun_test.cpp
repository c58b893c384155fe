// The 2-rank Fashion-MNIST DDP example launched by mpirun, without the cohort
// launcher, trains exactly as under `cohort run`: the same loss at every step
// and the same test accuracy, on the mpi backend (COHORT_BACKEND=mpi) and on
// the native one (rank, size and store host from Open MPI's variables).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <regex>

#include "mpi/mpirun_args.hpp"
#include "example_output.hpp"
#include "proc_util.hpp"
#include "test_deps.hpp"

namespace {

using cohort::testing::example_losses;

namespace fs = std::filesystem;
using cohort::testing::Proc;

struct JobResult {
  int code = -1;
  std::string out, err;
};

JobResult run(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
              const std::string& name) {
  std::vector<Proc> ps{cohort::testing::spawn(argv, env, std::string(COHORT_TEST_BIN_DIR) + "/ddp_mpirun_" + name)};
  EXPECT_TRUE(cohort::testing::wait_all(ps, std::chrono::seconds(900))) << name << " was killed after 900 s";
  return {ps[0].exit_code(), ps[0].out(), ps[0].err()};
}

std::string accuracy(const std::string& out) {
  std::smatch m;
  return std::regex_search(out, m, std::regex(R"(test accuracy ([0-9.]+)%)")) ? m[1].str() : "";
}

// One short epoch (32 steps of 128 images per rank), then the whole test set.
const std::vector<std::string> kRecipe = {COHORT_FASHION_MNIST_BIN,
                                          "--epochs",
                                          "1",
                                          "--train-limit",
                                          "8192",
                                          "--batch-size",
                                          "128",
                                          "--warmup-steps",
                                          "5",
                                          "--threads",
                                          "1",
                                          "--log-losses"};

#ifndef COHORT_MPIEXEC
#define COHORT_MPIEXEC "/usr/bin/mpirun"  // a build without the mpi backend: the native backend's case still runs
#endif

std::vector<std::string> under_mpirun() {
  std::vector<std::string> a = cohort::testing::mpirun_args(COHORT_MPIEXEC, 2);
  a.insert(a.end(), kRecipe.begin(), kRecipe.end());
  return a;
}

TEST(DdpMpirun, SameLossesAndAccuracyAsCohortRun) {
  if (!fs::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"))
    COHORT_MISSING_DEP("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)");
  if (access(COHORT_MPIEXEC, X_OK) != 0) COHORT_MISSING_DEP(COHORT_MPIEXEC " not installed (apt-get install openmpi-bin)");
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}};

  std::vector<std::string> launcher = {COHORT_BIN, "run", "--standalone", "--nproc-per-node", "2"};
  launcher.insert(launcher.end(), kRecipe.begin(), kRecipe.end());
  JobResult ref = run(launcher, env, "cohort_run");
  ASSERT_EQ(ref.code, 0) << ref.out << ref.err;
  const auto want = example_losses(ref.out);
  const std::string want_acc = accuracy(ref.out);
  ASSERT_GT(want.size(), 10u) << ref.out;
  ASSERT_FALSE(want_acc.empty()) << ref.out;

  for (std::string backend : {"mpi", "native"}) {
    auto e = env;
    e["COHORT_BACKEND"] = backend;
    e["MASTER_PORT"] = std::to_string(cohort::testing::free_port());  // native: rank 0 serves the store here
    JobResult got = run(under_mpirun(), e, backend);
    ASSERT_EQ(got.code, 0) << backend << "\n" << got.out << got.err;
    const auto have = example_losses(got.out);
    ASSERT_EQ(have.size(), want.size()) << backend << "\n" << got.out;
    for (const auto& [step, v] : want) EXPECT_NEAR(have.at(step), v, 1e-6) << backend << " step " << step;
    EXPECT_EQ(accuracy(got.out), want_acc) << backend << "\n" << got.out;
    std::printf("%s backend under mpirun: test accuracy %s%% (cohort run: %s%%)\n", backend.c_str(),
                accuracy(got.out).c_str(), want_acc.c_str());
    std::fflush(stdout);  // before the next fork: the child would print it again
  }
}

}  // namespace
