// The Fashion-MNIST example on 2 "hosts" of 2 ranks each (COHORT_HOST_ID
// splits one machine's 4 ranks: shared memory inside each host, TCP between
// them) trains as the same 4 ranks on one host: plain DDP, ZeRO-2 and FSDP,
// whose allreduce, reduce_scatter and allgather then run node-aware, each
// host's phases by single copy on the wrappers' shared buffers
// (docs/algorithms.md, "Across hosts").
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <regex>

#include "launch_harness.hpp"
#include "example_output.hpp"

namespace {

using cohort::testing::example_losses;

namespace lt = launch_test;
namespace fs = std::filesystem;

// `cohort run` of 4 ranks of the example; two_hosts: ranks 0-1 on host h0, 2-3 on h1.
lt::Result train(const std::vector<std::string>& flags, bool two_hosts) {
  std::string cmd = std::string(two_hosts ? "COHORT_HOST_ID=h$((LOCAL_RANK / 2)) " : "") + "exec " +
                    COHORT_FASHION_MNIST_BIN + " --epochs 1 --max-steps 12 --log-losses --augment none";
  for (const auto& f : flags) cmd += " " + f;
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}, {"COHORT_TIMEOUT", "120s"}};
  if (two_hosts) {
    env["COHORT_DEBUG"] = "TRACE";
    env["COHORT_DEBUG_SUBSYS"] = "COLL";
  }
  return lt::run({"run", "--standalone", "--nproc-per-node", "4", "/bin/sh", "-c", cmd}, env, 600);
}

struct Case {
  std::vector<std::string> flags;
  std::vector<std::string> traces;  // what the 2-host run must say it ran
};

TEST(TwoHosts, DdpZeroAndFsdpTrainAsOnOneHost) {
  if (!fs::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"))
    GTEST_SKIP() << "Fashion-MNIST is not installed (scripts/install-deps.sh installs dataset-fashion-mnist)";
  const std::vector<Case> cases = {
      {{"--model", "mlp"}, {"shared buffers on this host: its phases by single copy"}},
      {{"--model", "mlp", "--shard", "zero2", "--optimizer", "adamw"},
       {"shared inputs on this host: its phase by single copy", "shared outputs on this host: its phase by single copy"}},
      {{"--model", "mlp", "--shard", "fsdp", "--optimizer", "adamw"},
       {"shared inputs on this host: its phase by single copy", "shared outputs on this host: its phase by single copy"}},
  };
  for (const Case& c : cases) {
    std::string what;
    for (const auto& f : c.flags) what += f + " ";
    const lt::Result one = train(c.flags, false), two = train(c.flags, true);
    ASSERT_EQ(one.status, 0) << what << one.out << one.err.substr(0, 3000);
    ASSERT_EQ(two.status, 0) << what << two.out << two.err.substr(0, 3000);
    const auto want = example_losses(one.out), got = example_losses(two.out);
    ASSERT_EQ(want.size(), 12u) << what << one.out;
    ASSERT_EQ(got.size(), want.size()) << what << two.out;
    // The same sums in another order: the losses agree to float rounding.
    for (const auto& [step, v] : want) EXPECT_NEAR(got.at(step), v, 1e-4 * std::max(1.0, std::abs(v))) << what << "step " << step;
    EXPECT_TRUE(std::regex_search(two.err, std::regex(" algo hierarchical"))) << what << two.err.substr(0, 3000);
    for (const auto& t : c.traces) EXPECT_NE(two.err.find(t), std::string::npos) << what << "no '" << t << "'";
  }
}

}  // namespace
