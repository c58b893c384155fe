// The Fashion-MNIST example refuses bad flags before it starts: each message
// names the flag and what is wrong (a batch size of 0 used to end in SIGFPE,
// --resume without --checkpoint-dir or a negative --warmup-steps used to be
// ignored). Flags are checked before the rank is looked up, so the binary
// runs here without a launcher.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace {

// Exit status and what the example printed (stdout and stderr together).
std::pair<int, std::string> run_example(const std::string& args) {
  const std::string cmd = std::string(COHORT_FASHION_MNIST_BIN) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return {-1, "popen failed"};
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), p)) > 0;) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), out};
}

TEST(ExampleArgs, BadFlagsAreRefusedNamingTheFlag) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--batch-size 0", "--batch-size: must be greater than 0 (got 0)"},
      {"--epochs 0", "--epochs: must be greater than 0 (got 0)"},
      {"--lr -0.1", "--lr: must be greater than 0 (got -0.1)"},
      {"--threads 0", "--threads: must be greater than 0 (got 0)"},
      {"--bucket-cap-mb 0", "--bucket-cap-mb: must be greater than 0 (got 0)"},
      {"--warmup-steps -3", "--warmup-steps: must be 0 or more (got -3)"},
      {"--train-limit -5", "--train-limit: must be 0 or more (got -5)"},
      {"--clip-grad-norm -1", "--clip-grad-norm: must be 0 or more (got -1)"},
      {"--momentum -0.9", "--momentum: must be 0 or more (got -0.9)"},
      {"--keep many", "--keep: 'many' is not a number"},
      {"--lr inf", "--lr: 'inf' is not a number"},
      {"--bucket-cap-mb 1e300", "--bucket-cap-mb: must be at most 1048576 (got 1e300)"},
      {"--resume", "--resume requires --checkpoint-dir"},
  };
  for (const auto& [args, want] : cases) {
    auto [status, out] = run_example(args);
    EXPECT_NE(status, 0) << args;
    EXPECT_LT(status, 128) << args << ": killed by a signal\n" << out;
    EXPECT_NE(out.find(want), std::string::npos) << args << "\n" << out;
  }
}

// Device flags are checked once the group exists: under the launcher.
TEST(ExampleArgs, DeviceFlagsThatCannotWorkAreRefused) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a GPU is visible: --device cuda would work here";
  const std::string launch = std::string(COHORT_BIN) + " run --nproc-per-node ";
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      // A CPU LibTorch says so; a CUDA one on a machine without a GPU says that instead.
      {"1 --device cuda", {"--device cuda: ", "HINT", "--device cpu"}},
      {"1 --fp16-autocast", {"--fp16-autocast runs on a GPU (--device cuda), not on cpu"}},
      {"2 --no-ddp", {"--no-ddp trains one replica; this job has 2 ranks"}},
      {"1 --param-dtype bf16", {"--param-dtype is for --shard fsdp", "HINT"}},
      {"1 --cpu-offload", {"--cpu-offload is for --shard fsdp", "HINT"}},
      {"1 --shard fsdp --cpu-offload", {"cpu_offload is for a module on a GPU", "HINT"}},
      {"2 --shard fsdp --no-allreduce", {"--shard fsdp does not run with --no-allreduce"}},
      {"1 --shard fsdp --param-dtype bf16 --bf16-autocast", {"--shard fsdp does not run with --bf16-autocast and --param-dtype bf16"}},
  };
  for (const auto& [args, wants] : cases) {
    const auto space = args.find(' ');
    const std::string cmd = launch + args.substr(0, space) + " " + COHORT_FASHION_MNIST_BIN + args.substr(space) +
                            " --max-steps 2 --train-limit 256";
    FILE* p = popen((cmd + " 2>&1").c_str(), "r");
    ASSERT_NE(p, nullptr);
    std::string out;
    char buf[4096];
    for (size_t n; (n = fread(buf, 1, sizeof(buf), p)) > 0;) out.append(buf, n);
    const int status = pclose(p);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << args << "\n" << out;
    for (const auto& want : wants) EXPECT_NE(out.find(want), std::string::npos) << args << ": no '" << want << "'\n" << out;
  }
}

}  // namespace
