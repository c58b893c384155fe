// A model too large to replicate trains only sharded: the example's big-mlp
// (203 M parameters, 3.2 GB per replica with AdamW) at 4 ranks inside a
// memory cgroup of 8 GiB. DDP's four replicas (13 GB) are killed by the
// kernel's OOM killer; --shard fsdp, whose ranks each hold a quarter of the
// state and build the model already sharded, trains.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>

#include "launch_harness.hpp"
#include "test_deps.hpp"

namespace {

namespace lt = launch_test;
namespace fs = std::filesystem;

// A cgroup (v1 memory controller) with a hard limit that this process joins
// for its lifetime, so that the processes it starts are inside it; it moves
// back and removes the group on destruction.
class MemoryLimit {
 public:
  explicit MemoryLimit(uint64_t bytes) {
    const fs::path root = "/sys/fs/cgroup/memory";
    if (!fs::exists(root / "memory.limit_in_bytes")) return;
    std::ifstream self("/proc/self/cgroup");
    for (std::string line; std::getline(self, line);)
      if (const auto at = line.find(":memory:"); at != std::string::npos) home_ = root / line.substr(at + 9);
    dir_ = root / ("cohort-test-" + std::to_string(getpid()));
    std::error_code ec;
    fs::create_directory(dir_, ec);
    if (ec || !write(dir_ / "memory.limit_in_bytes", std::to_string(bytes)) || !write(dir_ / "cgroup.procs", "0")) {
      fs::remove(dir_, ec);
      dir_.clear();
    }
  }
  ~MemoryLimit() {
    if (dir_.empty()) return;
    write(home_ / "cgroup.procs", "0");
    std::error_code ec;
    fs::remove(dir_, ec);
  }
  bool active() const { return !dir_.empty(); }

 private:
  static bool write(const fs::path& file, const std::string& text) {
    std::ofstream out(file);
    out << text;
    out.flush();
    return static_cast<bool>(out);
  }
  fs::path dir_, home_;
};

std::vector<std::string> big_job(const char* shard) {
  return {"run", "--standalone", "--nproc-per-node", "4", COHORT_FASHION_MNIST_BIN, "--model", "big-mlp",
          "--optimizer", "adamw", "--max-steps", "2", "--warmup-timing-steps", "0", "--epochs", "1", "--shard", shard};
}

TEST(FsdpBigModel, TrainsShardedWhereDdpReplicasDoNotFit) {
  if (!fs::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"))
    COHORT_MISSING_DEP("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)");
  if (geteuid() != 0) GTEST_SKIP() << "needs root to create a memory cgroup";
  MemoryLimit limit(8ull << 30);
  if (!limit.active()) GTEST_SKIP() << "no writable cgroup v1 memory controller at /sys/fs/cgroup/memory";
  const std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}};

  auto sharded = lt::run(big_job("fsdp"), env, 600);
  ASSERT_EQ(sharded.status, 0) << sharded.out << sharded.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(sharded.out, m, std::regex(R"(RESULT memory model=big-mlp shard=fsdp world=4 peak_rss_mb=([0-9.]+))")))
      << sharded.out;
  EXPECT_NE(sharded.out.find("params=203053066"), std::string::npos) << sharded.out;

  auto replicated = lt::run(big_job("none"), env, 600);
  EXPECT_NE(replicated.status, 0) << "DDP's replicas fit in 8 GiB after all: " << replicated.out;
  EXPECT_NE(replicated.err.find("SIGKILL"), std::string::npos) << "expected the OOM killer: " << replicated.err;
}

}  // namespace
