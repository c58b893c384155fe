// DistributedDataParallel on CUDA modules (docs/gpu.md). Needs a GPU: every
// test skips without one (scripts/gpu-check.sh runs them on a GPU machine).
//   - world 1 on the nccl backend, the reducer forced on
//     (reduce_at_world_size_1): device buckets, copies on LibTorch's stream,
//     the NCCL stream ordered after it; several SGD steps equal one process
//     without DDP to 1e-5 relative;
//   - world 2 sharing the one GPU on the native backend (gradients staged
//     through host buckets): each rank's half batch gives the gradients of
//     one process on the whole batch. The ranks are processes (this test
//     binary started again for the one test), as under `cohort run`: LibTorch
//     runs the backward of every CUDA graph in a process on one thread per
//     device, so ranks as threads of one process would block each other there
//     (one rank's end-of-backward wait holds the thread the other's hooks need);
//   - the refusals: a module split across devices, a CPU module on nccl,
//     gradient_as_bucket_view with staging;
//   - ZeroOptimizer (ZeRO-1 and ZeRO-2) at world 1 on nccl: parameter
//     buckets, gradient shard, recycled gradient buckets and optimizer state
//     in the GPU's memory; AdamW with clipping equals LibTorch's in one
//     process (also with everything on a side stream), and a sharded state
//     saved mid-run resumes exactly; a GPU module on a host backend is
//     refused by name;
//   - FullyShardedDataParallel at world 1 on nccl: shards, gather slots,
//     gradient shards and optimizer state on the GPU, every allgather and
//     reduce-scatter through NCCL ordered after LibTorch's stream, the
//     stream (not the host) made to wait for them; AdamW with clipping
//     equals LibTorch's in one process (also on a side stream, also with
//     units sharded as they are built, also with the shards and the
//     optimizer step offloaded to the host); bf16 stays close; sharded
//     state saved mid-run resumes exactly; a GPU module on a host backend,
//     a CPU module on nccl and a split module are refused by name.
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "cohort/torch.hpp"
#include "cohort/torch_fsdp.hpp"
#include "cohort/torch_train.hpp"
#include "cohort/torch_zero.hpp"
#include "proc_util.hpp"
#include "test_util.hpp"
#include "torch/ddp_test_model.hpp"

namespace {

using cohort::testing::run_ranks;

constexpr const char* kRankVar = "COHORT_DDP_CUDA_TEST_RANK";

// Runs body(group) on `n` ranks of the native backend, each a process: this
// binary again, filtered to the current test, with RANK and WORLD_SIZE set
// (kRankVar marks it). In such a child it runs body on its own rank.
void in_rank_processes(int n, const std::function<void(cohort::ProcessGroup&)>& body) {
  if (std::getenv(kRankVar) != nullptr) {
    cohort::InitOptions o;
    o.backend = "native";
    auto pg = cohort::init_process_group(o);
    body(*pg);
    pg->shutdown();
    return;
  }
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string filter = std::string("--gtest_filter=") + info->test_suite_name() + "." + info->name();
  const std::string port = std::to_string(cohort::testing::free_port());
  const std::string logs = (std::filesystem::temp_directory_path() /
                            ("ddp_cuda_test." + std::to_string(::getpid()) + "." + info->name()))
                               .string();
  std::vector<cohort::testing::Proc> ranks;
  for (int r = 0; r < n; ++r) {
    const std::string rank = std::to_string(r), world = std::to_string(n);
    ranks.push_back(cohort::testing::spawn({exe, filter},
                                           {{kRankVar, rank},
                                            {"RANK", rank},
                                            {"LOCAL_RANK", rank},
                                            {"WORLD_SIZE", world},
                                            {"LOCAL_WORLD_SIZE", world},
                                            {"MASTER_ADDR", "127.0.0.1"},
                                            {"MASTER_PORT", port},
                                            {"COHORT_TIMEOUT", "60s"},
                                            // the child runs exactly this test, whatever sharding the parent runs under
                                            {"GTEST_SHARD_INDEX", "0"},
                                            {"GTEST_TOTAL_SHARDS", "1"},
                                            {"GTEST_OUTPUT", ""}},
                                           logs + ".rank" + rank));
  }
  const bool finished = cohort::testing::wait_all(ranks, std::chrono::seconds(180));
  EXPECT_TRUE(finished) << "a rank did not finish within 180 s and was killed";
  for (int r = 0; r < n; ++r)
    EXPECT_EQ(ranks[r].exit_code(), 0) << "rank " << r << " (exit " << ranks[r].exit_code() << ", signal "
                                       << ranks[r].term_signal() << "):\n"
                                       << ranks[r].out() << ranks[r].err();
  for (const auto& p : ranks) {
    std::filesystem::remove(p.out_path);
    std::filesystem::remove(p.err_path);
  }
}

#define REQUIRE_GPU()                 \
  if (!torch::cuda::is_available()) { \
    GTEST_SKIP() << "no CUDA GPU visible (this LibTorch: " << TORCH_VERSION << ")"; \
  }

const torch::Device kGpu(torch::kCUDA, 0);

using ddp_test::borrowed;
using ddp_test::inputs;
using ddp_test::Net;
using ddp_test::targets;

// max |got - want| <= rel * max |want| (+ a floor for all-zero tensors).
void expect_rel_close(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want, double rel,
                      const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(got[i].defined()) << what << ": tensor " << i << " undefined";
    auto g = got[i].detach().to(torch::kCPU, torch::kDouble), w = want[i].detach().to(torch::kCPU, torch::kDouble);
    const double err = (g - w).abs().max().item<double>(), scale = w.abs().max().item<double>();
    EXPECT_LE(err, rel * scale + 1e-12) << what << ": tensor " << i << " max error " << err << " of " << scale;
  }
}

std::vector<torch::Tensor> params_of(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}
std::vector<torch::Tensor> grads_of(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.grad().defined() ? p.grad().clone() : p.grad());
  return out;
}

// One process, no DDP, on the GPU: `steps` SGD steps on global batches of `n`.
std::vector<torch::Tensor> reference_params(int64_t n, int steps) {
  Net net;
  net->to(kGpu);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    torch::mse_loss(net->forward(inputs(s * n, n).to(kGpu)), targets(s * n, n).to(kGpu)).backward();
    opt.step();
  }
  return params_of(*net);
}

std::shared_ptr<cohort::ProcessGroup> nccl_world_of_one() {
  cohort::InitOptions o;
  o.backend = "nccl";
  o.rank = 0;
  o.world_size = 1;
  o.store = std::make_shared<cohort::MemoryStore>();
  return cohort::init_process_group(o);
}

struct NcclCase {
  const char* name;
  bool bucket_view;
  bool several_buckets;
  bool wait_on_stream = false;
};

TEST(DdpCuda, WorldOneOnNcclEqualsOneProcess) {
  REQUIRE_GPU();
  auto pg = nccl_world_of_one();
  ASSERT_EQ(pg->cuda_device(), 0);
  constexpr int64_t kBatch = 32;
  constexpr int kSteps = 4;
  const auto want = reference_params(kBatch, kSteps);
  for (const NcclCase& c : {NcclCase{"one bucket", false, false}, NcclCase{"several buckets", false, true},
                            NcclCase{"gradient_as_bucket_view", true, true},
                            NcclCase{"wait_on_stream", false, true, true},
                            NcclCase{"wait_on_stream, gradient_as_bucket_view", true, true, true}}) {
    Net net;
    net->to(kGpu);
    cohort::torch::DistributedDataParallelOptions o;
    o.reduce_at_world_size_1 = true;  // exercise the device buckets with one GPU
    o.gradient_as_bucket_view = c.bucket_view;
    o.wait_on_stream = c.wait_on_stream;
    if (c.several_buckets) {
      o.bucket_cap_mb = 0.0005;  // this model's 848 bytes of gradients in several buckets
      o.first_bucket_mb = 0.0002;
    }
    cohort::torch::DistributedDataParallel ddp(net.ptr(), pg, o);
    EXPECT_TRUE(ddp.device().is_cuda());
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      ddp.pre_forward();
      torch::mse_loss(net->forward(inputs(s * kBatch, kBatch).to(kGpu)), targets(s * kBatch, kBatch).to(kGpu))
          .backward();
      opt.step();
    }
    EXPECT_EQ(ddp.stats().iteration, uint64_t(kSteps - 1)) << c.name << ": the reducer ran every step";
    expect_rel_close(params_of(*net), want, 1e-5, c.name);
  }
}

TEST(DdpCuda, Fp16CompressionOnTheDevice) {
  REQUIRE_GPU();
  auto pg = nccl_world_of_one();
  Net ref;
  ref->to(kGpu);
  torch::mse_loss(ref->forward(inputs(0, 16).to(kGpu)), targets(0, 16).to(kGpu)).backward();
  for (auto [hook, name] : {std::pair{cohort::ddp::fp16_compress_hook(), "fp16"},
                            std::pair{cohort::ddp::bf16_compress_hook(), "bf16"}}) {
    Net net;
    net->to(kGpu);
    cohort::torch::DistributedDataParallelOptions o;
    o.reduce_at_world_size_1 = true;
    o.comm_hook = hook;
    cohort::torch::DistributedDataParallel ddp(net.ptr(), pg, o);
    ddp.pre_forward();
    torch::mse_loss(net->forward(inputs(0, 16).to(kGpu)), targets(0, 16).to(kGpu)).backward();
    // One rounding to the compressed type: 2^-11 (fp16) or 2^-8 (bf16) relative.
    expect_rel_close(grads_of(*net), grads_of(*ref), std::string(name) == "fp16" ? 1e-3 : 8e-3, name);
  }
}

TEST(DdpCuda, TwoRanksShareTheGpuOnTheNativeBackend) {
  REQUIRE_GPU();
  constexpr int64_t kBatch = 32;
  constexpr int kSteps = 4;
  const auto want = reference_params(kBatch, kSteps);
  in_rank_processes(2, [&](cohort::ProcessGroup& pg) {
    const int r = pg.rank();
    Net net;
    net->to(kGpu);
    cohort::torch::DistributedDataParallelOptions o;
    o.bucket_cap_mb = 0.0005;
    o.first_bucket_mb = 0.0002;
    cohort::torch::DistributedDataParallel ddp(net.ptr(), borrowed(pg), o);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    const int64_t half = kBatch / 2;
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      ddp.pre_forward();
      const int64_t from = s * kBatch + r * half;
      torch::mse_loss(net->forward(inputs(from, half).to(kGpu)), targets(from, half).to(kGpu)).backward();
      opt.step();
    }
    expect_rel_close(params_of(*net), want, 1e-5, "rank " + std::to_string(r));
  });
}

TEST(DdpCuda, StagedFindUnusedAndNoSync) {
  REQUIRE_GPU();
  // Two micro-batches accumulated (the first under no_sync) on each of two
  // ranks: the gradients of one process on all four micro-batches.
  Net ref(true);
  ref->to(kGpu);
  for (int m = 0; m < 4; ++m) torch::mse_loss(ref->forward(inputs(m * 8, 8).to(kGpu)), targets(m * 8, 8).to(kGpu)).backward();
  std::vector<torch::Tensor> want;
  for (auto& g : grads_of(*ref)) want.push_back(g.defined() ? g / 4 : g);
  in_rank_processes(2, [&](cohort::ProcessGroup& pg) {
    const int r = pg.rank();
    Net net(true);
    net->to(kGpu);
    cohort::torch::DistributedDataParallelOptions o;
    o.find_unused_parameters = true;
    cohort::torch::DistributedDataParallel ddp(net.ptr(), borrowed(pg), o);
    {
      auto guard = ddp.no_sync();
      ddp.pre_forward();
      torch::mse_loss(net->forward(inputs(r * 16, 8).to(kGpu)), targets(r * 16, 8).to(kGpu)).backward();
    }
    ddp.pre_forward();
    torch::mse_loss(net->forward(inputs(r * 16 + 8, 8).to(kGpu)), targets(r * 16 + 8, 8).to(kGpu)).backward();
    auto got = grads_of(*net);
    EXPECT_FALSE(got.back().defined()) << "the spare layer had no gradient anywhere: it stays none";
    got.pop_back();
    got.pop_back();
    want.resize(got.size());
    for (auto& g : got) g = g / 2;  // each rank's sum of two micro-batch means, averaged: /2 more for the mean of 4
    expect_rel_close(got, want, 1e-5, "rank " + std::to_string(r));
  });
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(DdpCuda, RefusesWhatCannotWork) {
  REQUIRE_GPU();
  {
    auto pg = nccl_world_of_one();
    Net split;
    split->fc1->to(kGpu);  // fc2 stays on the CPU
    std::string m = error_of([&] { cohort::torch::DistributedDataParallel(split.ptr(), pg); });
    EXPECT_NE(m.find("split across devices"), std::string::npos) << m;
    EXPECT_NE(m.find("fc2.weight"), std::string::npos) << m;
    Net cpu;
    m = error_of([&] { cohort::torch::DistributedDataParallel(cpu.ptr(), pg); });
    EXPECT_NE(m.find("moves GPU memory only"), std::string::npos) << m;
  }
  run_ranks(1, "shm", [&](cohort::ProcessGroup& pg) {
    Net net;
    net->to(kGpu);
    cohort::torch::DistributedDataParallelOptions o;
    o.gradient_as_bucket_view = true;
    std::string m = error_of([&] { cohort::torch::DistributedDataParallel(net.ptr(), borrowed(pg), o); });
    EXPECT_NE(m.find("gradient_as_bucket_view needs the buckets on the module's device"), std::string::npos) << m;
  });
}

TEST(DdpCuda, CheckpointFromTheGpuLoadsOnTheCpu) {
  REQUIRE_GPU();
  Net gpu;
  gpu->to(kGpu);
  {
    torch::NoGradGuard g;
    for (auto& p : gpu->parameters()) p.add_(1.0);
  }
  Net cpu;
  cohort::torch::load_module_state(*cpu, cohort::torch::module_state(*gpu));
  expect_rel_close(params_of(*cpu), params_of(*gpu), 0, "module state");
}

// ZeRO on the GPU (docs/zero.md): at world 1 on nccl every bucket, the
// gradient shard and the shard optimizer's state are GPU memory and every
// reduce-scatter and allgather goes through NCCL, ordered after LibTorch's
// stream. AdamW with clipping by the global norm, 20 steps, equals
// LibTorch's AdamW in one process; the state saved after 10 steps (with the
// module's) resumes into a new optimizer exactly.
cohort::torch::ZeroOptions zero_options(cohort::torch::ZeroStage stage) {
  cohort::torch::ZeroOptions o;
  o.stage = stage;
  o.bucket_cap_mb = 0.0005;  // several buckets, recycled in ZeRO-2
  o.first_bucket_mb = 0.0002;
  return o;
}

void zero_cuda_steps(cohort::torch::ZeroOptimizer& opt, Net& net, int from, int to) {
  constexpr int64_t kBatch = 32;
  for (int s = from; s < to; ++s) {
    opt.zero_grad();
    opt.pre_forward();
    torch::mse_loss(net->forward(inputs(s * kBatch, kBatch).to(kGpu)), targets(s * kBatch, kBatch).to(kGpu)).backward();
    opt.clip_grad_norm(0.5);
    opt.step();
  }
}

TEST(ZeroCuda, WorldOneOnNcclEqualsOneProcessAndResumes) {
  REQUIRE_GPU();
  auto pg = nccl_world_of_one();
  const auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  constexpr int64_t kBatch = 32;
  constexpr int kSteps = 20;
  Net ref;
  ref->to(kGpu);
  torch::optim::AdamW plain(ref->parameters(), adamw);
  for (int s = 0; s < kSteps; ++s) {
    plain.zero_grad();
    torch::mse_loss(ref->forward(inputs(s * kBatch, kBatch).to(kGpu)), targets(s * kBatch, kBatch).to(kGpu)).backward();
    torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.5);
    plain.step();
  }
  const auto want = params_of(*ref);
  for (auto stage : {cohort::torch::ZeroStage::One, cohort::torch::ZeroStage::Two}) {
    const std::string name = "ZeRO-" + std::to_string(static_cast<int>(stage));
    Net net;
    net->to(kGpu);
    cohort::torch::ZeroOptimizer opt(net.ptr(), pg, adamw, zero_options(stage));
    ASSERT_TRUE(opt.ddp().device().is_cuda()) << name;
    zero_cuda_steps(opt, net, 0, kSteps / 2);
    const auto shard = opt.state_shard();
    const auto module = cohort::torch::module_state(*net);
    zero_cuda_steps(opt, net, kSteps / 2, kSteps);
    for (const auto& p : net->parameters()) EXPECT_TRUE(p.is_cuda()) << name << ": a parameter left the GPU";
    for (const auto& g : opt.shard_optimizer().param_groups())
      for (const auto& p : g.params()) EXPECT_TRUE(p.is_cuda() && p.grad().is_cuda()) << name;
    EXPECT_GT(opt.memory().optimizer_state_bytes, 0u) << name;
    expect_rel_close(params_of(*net), want, 1e-5, name);

    Net again;
    again->to(kGpu);
    cohort::torch::load_module_state(*again, module);
    cohort::torch::ZeroOptimizer resumed(again.ptr(), pg, adamw, zero_options(stage));
    resumed.load_state_shards([&](int) { return shard; });
    zero_cuda_steps(resumed, again, kSteps / 2, kSteps);
    expect_rel_close(params_of(*again), params_of(*net), 1e-6, name + " resumed");

    // The same training with forward, backward and step on a side stream
    // (not the legacy default stream NCCL would otherwise follow): every
    // copy, reduce-scatter and allgather must be ordered after it.
    Net side;
    side->to(kGpu);
    {
      c10::StreamGuard on(c10::impl::getDeviceGuardImpl(torch::kCUDA)->getStreamFromGlobalPool(kGpu));
      cohort::torch::ZeroOptimizer sopt(side.ptr(), pg, adamw, zero_options(stage));
      zero_cuda_steps(sopt, side, 0, kSteps);
      torch::cuda::synchronize();
    }
    expect_rel_close(params_of(*side), want, 1e-5, name + " on a side stream");
  }
}

TEST(ZeroCuda, AGpuModuleOnAHostBackendIsRefused) {
  REQUIRE_GPU();
  run_ranks(1, "shm", [&](cohort::ProcessGroup& pg) {
    Net net;
    net->to(kGpu);
    std::string m = error_of([&] {
      cohort::torch::ZeroOptimizer(net.ptr(), borrowed(pg), torch::optim::AdamWOptions(1e-3));
    });
    EXPECT_NE(m.find("needs the nccl"), std::string::npos) << m;
  });
}

// ---- FSDP on the GPU (docs/fsdp.md) ----

using cohort::torch::FsdpUnit;
using cohort::torch::FullyShardedDataParallel;

// Two units and a root (the head): gathers, prefetches and reductions of
// several units per step.
struct UnitNetImpl : torch::nn::Module {
  UnitNetImpl() {
    a = register_module("a", std::make_shared<FsdpUnit<torch::nn::Linear>>(torch::nn::Linear(8, 32)));
    b = register_module("b", std::make_shared<FsdpUnit<torch::nn::Linear>>(torch::nn::Linear(32, 32)));
    head = register_module("head", torch::nn::Linear(32, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return head->forward(torch::tanh(b->forward(torch::tanh(a->forward(x))))); }
  std::shared_ptr<FsdpUnit<torch::nn::Linear>> a, b;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(UnitNet);

const auto kFsdpAdamW = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
constexpr int64_t kFsdpBatch = 32;
constexpr int kFsdpSteps = 20;

// The values of a fresh UnitNet, to start every run from (each construction draws others).
std::vector<cohort::NamedTensor> unit_net_start() {
  UnitNet net;
  return cohort::torch::module_state(*net);
}

// A UnitNet with `start`'s values, on the GPU.
UnitNet unit_net_on_gpu(const std::vector<cohort::NamedTensor>& start) {
  UnitNet net;
  cohort::torch::load_module_state(*net, start);
  net->to(kGpu);
  return net;
}

// One process, no FSDP: AdamW with clipping on the GPU.
std::vector<torch::Tensor> fsdp_reference(const std::vector<cohort::NamedTensor>& start) {
  UnitNet ref = unit_net_on_gpu(start);
  torch::optim::AdamW plain(ref->parameters(), kFsdpAdamW);
  for (int s = 0; s < kFsdpSteps; ++s) {
    plain.zero_grad();
    const int64_t at = s * kFsdpBatch;
    torch::mse_loss(ref->forward(inputs(at, kFsdpBatch).to(kGpu)), targets(at, kFsdpBatch).to(kGpu)).backward();
    torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.5);
    plain.step();
  }
  return params_of(*ref);
}

void fsdp_cuda_steps(FullyShardedDataParallel& fsdp, torch::optim::AdamW& opt, UnitNet& net, int from, int to,
                     torch::ScalarType compute = torch::kFloat) {
  for (int s = from; s < to; ++s) {
    fsdp.zero_grad();
    fsdp.pre_forward();
    const int64_t at = s * kFsdpBatch;
    auto y = net->forward(inputs(at, kFsdpBatch).to(kGpu, compute)).to(torch::kFloat);
    torch::mse_loss(y, targets(at, kFsdpBatch).to(kGpu)).backward();
    fsdp.clip_grad_norm(0.5);
    opt.step();
  }
}

// The trained parameters, in the module's order, from full_state().
std::vector<torch::Tensor> full_params(FullyShardedDataParallel& fsdp) {
  std::vector<torch::Tensor> out;
  for (const auto& t : fsdp.full_state()) out.push_back(cohort::torch::from_named(t));
  return out;
}

// Steps [kFsdpSteps / 2, kFsdpSteps) of a fresh FSDP (shards on the GPU)
// after loading `model` and `optim`, saved at kFsdpSteps / 2 by a run that
// went on to `uninterrupted`: the same parameters.
void expect_resumes_on_the_gpu(const std::shared_ptr<cohort::ProcessGroup>& pg,
                               const std::vector<cohort::NamedTensor>& model, const std::vector<cohort::NamedTensor>& optim,
                               FullyShardedDataParallel& uninterrupted, const std::string& what) {
  UnitNet again;
  again->to(kGpu);
  FullyShardedDataParallel resumed(again.ptr(), pg);
  torch::optim::AdamW ropt(resumed.parameters(), kFsdpAdamW);
  resumed.load_state_shards([&](int) { return model; });
  resumed.load_optimizer_state_shards(ropt, [&](int) { return optim; });
  fsdp_cuda_steps(resumed, ropt, again, kFsdpSteps / 2, kFsdpSteps);
  expect_rel_close(full_params(resumed), full_params(uninterrupted), 1e-6, what);
}

// A UnitNet built under FsdpShardedInit on `pg` (its units sharded onto the
// GPU as they are built), the root moved there after.
std::shared_ptr<UnitNetImpl> built_sharded(const std::shared_ptr<cohort::ProcessGroup>& pg) {
  std::shared_ptr<UnitNetImpl> built;
  {
    cohort::torch::FsdpShardedInit sharded(pg);
    built = std::make_shared<UnitNetImpl>();
  }
  built->to(kGpu);
  return built;
}

// bf16 compute against the float32 reference: lr 1e-2 x 20 steps moves
// weights by ~0.2; bf16 rounding stays well below 2e-2.
void expect_bf16_close(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_LT((got[i].to(torch::kCPU) - want[i].to(torch::kCPU)).abs().max().item<double>(), 2e-2) << "tensor " << i;
}

TEST(FsdpCuda, WorldOneOnNcclEqualsOneProcessAndResumes) {
  REQUIRE_GPU();
  auto pg = nccl_world_of_one();
  const auto start = unit_net_start();
  const auto want = fsdp_reference(start);
  UnitNet net = unit_net_on_gpu(start);
  FullyShardedDataParallel fsdp(net.ptr(), pg, {.prefetch = 1});
  for (const auto& p : fsdp.parameters()) ASSERT_TRUE(p.is_cuda() && p.grad().is_cuda()) << "a shard off the GPU";
  torch::optim::AdamW opt(fsdp.parameters(), kFsdpAdamW);
  fsdp_cuda_steps(fsdp, opt, net, 0, kFsdpSteps / 2);
  const auto model = fsdp.state_shard();
  const auto optim = fsdp.optimizer_state_shard(opt);
  fsdp_cuda_steps(fsdp, opt, net, kFsdpSteps / 2, kFsdpSteps);
  for (const auto& p : net->parameters()) EXPECT_TRUE(p.is_cuda()) << "a parameter left the GPU";
  for (const auto* unit : {&net->a, &net->b})  // (the root unit, the head, stays gathered until the next pre_forward)
    for (const auto& p : (*unit)->parameters()) EXPECT_EQ(p.storage().nbytes(), 0u) << "a unit left gathered";
  expect_rel_close(full_params(fsdp), want, 1e-5, "FSDP");
  expect_resumes_on_the_gpu(pg, model, optim, fsdp, "FSDP resumed");
}

// Forward, backward and step on a side stream, prefetching two units: every
// gather, copy and reduce-scatter must follow that stream, not the legacy
// default one NCCL would otherwise be ordered after.
TEST(FsdpCuda, ASideStreamAndUnitsShardedAsTheyAreBuilt) {
  REQUIRE_GPU();
  auto pg = nccl_world_of_one();
  const auto start = unit_net_start();
  const auto want = fsdp_reference(start);
  {
    UnitNet side = unit_net_on_gpu(start);
    c10::StreamGuard on(c10::impl::getDeviceGuardImpl(torch::kCUDA)->getStreamFromGlobalPool(kGpu));
    FullyShardedDataParallel fsdp(side.ptr(), pg, {.prefetch = 2});
    torch::optim::AdamW opt(fsdp.parameters(), kFsdpAdamW);
    fsdp_cuda_steps(fsdp, opt, side, 0, kFsdpSteps);
    expect_rel_close(full_params(fsdp), want, 1e-5, "FSDP on a side stream");
  }
  // Built on the default stream, trained on a side stream: autograd runs the
  // gradient hooks (the reductions) on the stream the accumulators were made
  // on, forward and the gathers on the side stream, so slots and reduction
  // buffers pass between two streams every step.
  {
    UnitNet two = unit_net_on_gpu(start);
    FullyShardedDataParallel fsdp(two.ptr(), pg, {.prefetch = 1});
    torch::optim::AdamW opt(fsdp.parameters(), kFsdpAdamW);
    c10::StreamGuard on(c10::impl::getDeviceGuardImpl(torch::kCUDA)->getStreamFromGlobalPool(kGpu));
    fsdp_cuda_steps(fsdp, opt, two, 0, kFsdpSteps);
    expect_rel_close(full_params(fsdp), want, 1e-5, "FSDP built on one stream, trained on another");
  }
  // Built under FsdpShardedInit on nccl: each unit lands on the GPU as it is
  // sharded (never whole there); the root follows with module->to().
  const auto built = built_sharded(pg);
  for (const auto& p : built->a->parameters()) EXPECT_TRUE(p.is_cuda() && p.storage().nbytes() == 0);
  UnitNet net(built);
  FullyShardedDataParallel fsdp(built, pg);
  fsdp.load_full_state(start);
  torch::optim::AdamW opt(fsdp.parameters(), kFsdpAdamW);
  fsdp_cuda_steps(fsdp, opt, net, 0, kFsdpSteps);
  expect_rel_close(full_params(fsdp), want, 1e-5, "FSDP built sharded");
}

// bf16 gathers and compute over float32 master shards: close to float32.
TEST(FsdpCuda, MixedPrecisionStaysClose) {
  REQUIRE_GPU();
  auto pg = nccl_world_of_one();
  const auto start = unit_net_start();
  const auto want = fsdp_reference(start);
  UnitNet net = unit_net_on_gpu(start);
  FullyShardedDataParallel fsdp(net.ptr(), pg, {.param_dtype = torch::kBFloat16});
  for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
  torch::optim::AdamW opt(fsdp.parameters(), kFsdpAdamW);
  fsdp_cuda_steps(fsdp, opt, net, 0, kFsdpSteps, torch::kBFloat16);
  for (const auto& p : fsdp.parameters()) EXPECT_EQ(p.grad().scalar_type(), torch::kFloat);
  expect_bf16_close(full_params(fsdp), want);
}

// cpu_offload: the shards, their gradients and AdamW's state on the host,
// the units gathered on the GPU; the same training.
TEST(FsdpCuda, CpuOffloadEqualsOneProcess) {
  REQUIRE_GPU();
  auto pg = nccl_world_of_one();
  const auto start = unit_net_start();
  const auto want = fsdp_reference(start);
  UnitNet net = unit_net_on_gpu(start);
  FullyShardedDataParallel fsdp(net.ptr(), pg, {.cpu_offload = true});
  for (const auto& p : fsdp.parameters()) EXPECT_TRUE(p.is_cpu() && p.grad().is_cpu()) << "a shard on the GPU";
  torch::optim::AdamW opt(fsdp.parameters(), kFsdpAdamW);
  fsdp_cuda_steps(fsdp, opt, net, 0, kFsdpSteps / 2);
  const auto model = fsdp.state_shard();
  const auto optim = fsdp.optimizer_state_shard(opt);
  fsdp_cuda_steps(fsdp, opt, net, kFsdpSteps / 2, kFsdpSteps);
  for (const auto& p : net->parameters()) EXPECT_TRUE(p.is_cuda()) << "a unit's parameter left the GPU";
  expect_rel_close(full_params(fsdp), want, 1e-5, "FSDP with cpu_offload");

  // Its state resumes in an FSDP without offload (the shards on the GPU).
  expect_resumes_on_the_gpu(pg, model, optim, fsdp, "offloaded state resumed on the GPU");

  // Built sharded, offloaded, bf16: the chunk comes down from the GPU at
  // construction and goes up cast to bf16 at every gather.
  const auto built = built_sharded(pg);
  UnitNet mixed(built);
  FullyShardedDataParallel bf16(built, pg, {.param_dtype = torch::kBFloat16, .cpu_offload = true});
  bf16.load_full_state(start);
  torch::optim::AdamW mopt(bf16.parameters(), kFsdpAdamW);
  fsdp_cuda_steps(bf16, mopt, mixed, 0, kFsdpSteps, torch::kBFloat16);
  expect_bf16_close(full_params(bf16), want);
}

TEST(FsdpCuda, WrongPlacementsAreRefused) {
  REQUIRE_GPU();
  run_ranks(1, "shm", [&](cohort::ProcessGroup& pg) {
    UnitNet net;
    net->to(kGpu);
    std::string m = error_of([&] { FullyShardedDataParallel f(net.ptr(), borrowed(pg)); });
    EXPECT_NE(m.find("needs the nccl"), std::string::npos) << m;
  });
  auto pg = nccl_world_of_one();
  UnitNet cpu;
  std::string m = error_of([&] { FullyShardedDataParallel f(cpu.ptr(), pg); });
  EXPECT_NE(m.find("moves GPU memory only"), std::string::npos) << m;
  UnitNet split;
  split->head->to(kGpu);
  m = error_of([&] { FullyShardedDataParallel f(split.ptr(), pg); });
  EXPECT_NE(m.find("split across devices"), std::string::npos) << m;
}

}  // namespace
