// The Fashion-MNIST example's benchmark modes, which bench/ddp_scaling.py
// divides by: --no-allreduce (no gradient traffic, no waiting: the compute
// ceiling) and --no-allreduce --lockstep (no gradient traffic, one barrier per
// step). Both are 2-rank runs with COHORT_TIMELINE; the trace shows what each
// step did. --lockstep alone is refused.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "launch_harness.hpp"
#include "test_deps.hpp"

namespace {

namespace lt = launch_test;
namespace fs = std::filesystem;
using nlohmann::json;

constexpr int kSteps = 5;

bool have_data() { return fs::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"); }

json trace(const std::string& dir, int rank) {
  std::ifstream in(dir + "/rank" + std::to_string(rank) + ".json");
  std::stringstream ss;
  ss << in.rdbuf();
  json j = json::parse(ss.str());
  return j.is_object() ? j["traceEvents"] : j;
}

size_t count(const json& ev, const std::string& ph, const std::string& name_prefix) {
  size_t n = 0;
  for (const auto& e : ev)
    if (e.value("ph", "") == ph && e.value("name", "").rfind(name_prefix, 0) == 0) ++n;
  return n;
}

// Runs 2 ranks for kSteps steps with `mode_flags`; returns the timeline directory.
std::string run_mode(const std::vector<std::string>& mode_flags, std::string* out) {
  std::string dir = lt::temp_dir() + "/tl";
  std::vector<std::string> args{"run", "--standalone", "--nproc-per-node", "2", COHORT_FASHION_MNIST_BIN, "--epochs", "1",
                                "--max-steps", std::to_string(kSteps), "--threads", "1"};
  args.insert(args.end(), mode_flags.begin(), mode_flags.end());
  auto r = lt::run(args, {{"OMP_NUM_THREADS", "1"}, {"COHORT_TIMELINE", dir}}, 600);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  *out = r.out;
  return dir;
}

TEST(BenchModes, LockstepWaitsOncePerStepWithoutGradientTraffic) {
  if (!have_data()) COHORT_MISSING_DEP("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)");
  std::string out;
  std::string dir = run_mode({"--no-allreduce", "--lockstep"}, &out);
  EXPECT_NE(out.find("allreduce=off+barrier"), std::string::npos) << out;
  for (int rank : {0, 1}) {
    json ev = trace(dir, rank);
    EXPECT_EQ(count(ev, "X", "step"), size_t(kSteps)) << "rank " << rank;
    EXPECT_EQ(count(ev, "X", "lockstep barrier"), size_t(kSteps)) << "rank " << rank;
    EXPECT_GE(count(ev, "X", "barrier"), size_t(kSteps)) << "rank " << rank << ": the collective itself";
    EXPECT_EQ(count(ev, "b", "bucket "), 0u) << "rank " << rank << ": no gradient bucket may be reduced";
  }
}

TEST(BenchModes, NoAllreduceNeitherReducesNorWaits) {
  if (!have_data()) COHORT_MISSING_DEP("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)");
  std::string out;
  std::string dir = run_mode({"--no-allreduce"}, &out);
  EXPECT_NE(out.find("allreduce=off\n"), std::string::npos) << out;
  for (int rank : {0, 1}) {
    json ev = trace(dir, rank);
    EXPECT_EQ(count(ev, "X", "step"), size_t(kSteps)) << "rank " << rank;
    EXPECT_EQ(count(ev, "X", "lockstep barrier"), 0u) << "rank " << rank;
    EXPECT_EQ(count(ev, "b", "bucket "), 0u) << "rank " << rank;
  }
}

TEST(BenchModes, LockstepWithoutNoAllreduceIsRefused) {
  auto r = lt::run({"run", "--standalone", "--nproc-per-node", "1", COHORT_FASHION_MNIST_BIN, "--lockstep"}, {}, 60);
  EXPECT_NE(r.status, 0);
  EXPECT_NE((r.out + r.err).find("--no-allreduce"), std::string::npos) << r.out << r.err;
}

}  // namespace
