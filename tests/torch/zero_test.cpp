// ZeroOptimizer (ZeRO-1/2): after every step each rank holds the parameters
// that one process gets training on the whole global batch, and keeps 1/N of
// the optimizer state. Ranks run as threads over a MemoryStore.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <set>

#include "cohort/torch_tensor_parallel.hpp"
#include "cohort/torch_zero.hpp"
#include "test_util.hpp"
#include "torch/ddp_test_model.hpp"
#include "torch/device.hpp"
#include "torch/device_mode.hpp"
#include "torch/shard_state.hpp"

namespace {

using cohort::testing::run_ranks;
using cohort::torch::ZeroOptimizer;
using cohort::torch::ZeroOptions;
using cohort::torch::ZeroStage;
using ddp_test::borrowed;
using ddp_test::DeviceModeOnCpu;
using ddp_test::inputs;
using ddp_test::Net;
using ddp_test::targets;

constexpr int64_t kGlobal = 24;  // divides by 1, 2, 3 and 4

// Caps so small that the model's 212 parameters fill several buckets.
ZeroOptions small_buckets(ZeroStage stage) {
  ZeroOptions o;
  o.stage = stage;
  o.bucket_cap_mb = 0.0005;
  o.first_bucket_mb = 0.0002;
  return o;
}

torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.1); }

std::vector<torch::Tensor> params_of(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

// Largest |a - b| / max(|b|, 1e-3) over every element: relative error with a floor near zero.
double rel_error(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, ((a[i] - b[i]).abs() / b[i].abs().clamp_min(1e-3)).max().item<double>());
  return worst;
}

// One process, LibTorch's own AdamW, on the whole global batch: `steps`
// steps of `micro` accumulated micro-batches each, optionally clipped.
std::vector<torch::Tensor> reference(torch::ScalarType type, int steps, int micro = 1, double clip = 0) {
  Net net;
  net->to(type);
  torch::optim::AdamW opt(net->parameters(), adamw());
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    for (int m = 0; m < micro; ++m) {
      const int64_t from = (s * micro + m) * kGlobal;
      torch::mse_loss(net->forward(inputs(from, kGlobal).to(type)), targets(from, kGlobal).to(type)).backward();
    }
    if (clip > 0) torch::nn::utils::clip_grad_norm_(net->parameters(), clip);
    opt.step();
  }
  return params_of(*net);
}

// The same training with ZeRO at `world` ranks; rank r's samples are its
// slice of each global micro-batch. first_no_sync: every micro-batch but the
// last runs under no_sync().
std::vector<std::vector<torch::Tensor>> train_zero(int world, ZeroStage stage, torch::ScalarType type, int steps,
                                                   int micro = 1, bool first_no_sync = false, double clip = 0) {
  std::vector<std::vector<torch::Tensor>> out(world);
  run_ranks(world, "shm", [&](cohort::ProcessGroup& pg) {
    torch::set_num_threads(1);
    Net net;
    net->to(type);
    ZeroOptimizer opt(net.ptr(), borrowed(pg), adamw(), small_buckets(stage));
    const int64_t local = kGlobal / world;
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      for (int m = 0; m < micro; ++m) {
        const int64_t from = (s * micro + m) * kGlobal + pg.rank() * local;
        opt.pre_forward();
        auto loss = torch::mse_loss(net->forward(inputs(from, local).to(type)), targets(from, local).to(type));
        if (first_no_sync && m + 1 < micro) {
          auto guard = opt.no_sync();
          loss.backward();
        } else {
          loss.backward();
        }
      }
      if (clip > 0) opt.clip_grad_norm(clip);
      opt.step();
    }
    out[pg.rank()] = params_of(*net);
  });
  return out;
}

struct Case {
  ZeroStage stage;
  int world;
  bool device = false;  // the device path, on the CPU (DeviceModeOnCpu)
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << "ZeRO-" << static_cast<int>(c.stage) << " x " << c.world << (c.device ? " device path" : "");
}
class Zero : public ::testing::TestWithParam<Case> {};

// The bar: AdamW over 100 steps, 1e-6 relative (float64, where the
// reduction order is the only difference).
TEST_P(Zero, AdamW100StepsEqualOneProcessOnTheGlobalBatch) {
  const auto [stage, world, device] = GetParam();
  DeviceModeOnCpu path(device);
  const auto want = reference(torch::kDouble, 100);
  const auto got = train_zero(world, stage, torch::kDouble, 100);
  for (int r = 0; r < world; ++r) EXPECT_LT(rel_error(got[r], want), 1e-6) << "rank " << r;
}

// float32 takes the fused AdamW loop on the shard; LibTorch's step is the reference.
TEST_P(Zero, Float32IsCloseToOneProcess) {
  const auto [stage, world, device] = GetParam();
  DeviceModeOnCpu path(device);
  const auto want = reference(torch::kFloat, 30);
  const auto got = train_zero(world, stage, torch::kFloat, 30);
  for (int r = 0; r < world; ++r) EXPECT_LT(rel_error(got[r], want), 1e-4) << "rank " << r;
}

TEST_P(Zero, AccumulatesMicroBatchesSyncedOrUnderNoSync) {
  const auto [stage, world, device] = GetParam();
  DeviceModeOnCpu path(device);
  const auto want = reference(torch::kDouble, 5, 3);
  for (bool no_sync : {false, true}) {
    const auto got = train_zero(world, stage, torch::kDouble, 5, 3, no_sync);
    for (int r = 0; r < world; ++r) EXPECT_LT(rel_error(got[r], want), 1e-9) << "rank " << r << " no_sync " << no_sync;
  }
}

TEST_P(Zero, ClipsByTheGlobalNorm) {
  const auto [stage, world, device] = GetParam();
  DeviceModeOnCpu path(device);
  const auto want = reference(torch::kDouble, 10, 1, 0.05);  // small enough to clip every step
  const auto got = train_zero(world, stage, torch::kDouble, 10, 1, false, 0.05);
  for (int r = 0; r < world; ++r) EXPECT_LT(rel_error(got[r], want), 1e-9) << "rank " << r;
}

std::vector<Case> cases() {
  std::vector<Case> c;
  for (ZeroStage s : {ZeroStage::One, ZeroStage::Two}) {
    for (int w : {1, 2, 3, 4}) c.push_back({s, w});
    for (int w : {1, 3}) c.push_back({s, w, true});
  }
  return c;
}
INSTANTIATE_TEST_SUITE_P(All, Zero, ::testing::ValuesIn(cases()), [](const auto& info) {
  return "Zero" + std::to_string(static_cast<int>(info.param.stage)) + "_np" + std::to_string(info.param.world) +
         (info.param.device ? "_device" : "");
});

// The clipping norm is the whole averaged gradient's, on every rank.
TEST(ZeroClip, NormIsTheGlobalGradientNorm) {
  Net ref;
  ref->to(torch::kDouble);
  torch::mse_loss(ref->forward(inputs(0, kGlobal).to(torch::kDouble)), targets(0, kGlobal).to(torch::kDouble)).backward();
  const double want = torch::nn::utils::clip_grad_norm_(ref->parameters(), 1e9);
  for (ZeroStage stage : {ZeroStage::One, ZeroStage::Two})
    run_ranks(3, "shm", [&](cohort::ProcessGroup& pg) {
      torch::set_num_threads(1);
      Net net;
      net->to(torch::kDouble);
      ZeroOptimizer opt(net.ptr(), borrowed(pg), adamw(), small_buckets(stage));
      const int64_t local = kGlobal / 3;
      opt.pre_forward();
      torch::mse_loss(net->forward(inputs(pg.rank() * local, local).to(torch::kDouble)),
                      targets(pg.rank() * local, local).to(torch::kDouble))
          .backward();
      EXPECT_NEAR(opt.clip_grad_norm(1e9), want, 1e-12 * want) << "rank " << pg.rank();
    });
}

// Gradients set to none by the user (the module's zero_grad in LibTorch 2.x)
// are taken from where backward put them.
TEST(ZeroGrads, SetToNoneByTheUserStillReduces) {
  const auto want = reference(torch::kDouble, 3);
  for (ZeroStage stage : {ZeroStage::One, ZeroStage::Two}) {
    std::vector<std::vector<torch::Tensor>> got(2);
    run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
      torch::set_num_threads(1);
      Net net;
      net->to(torch::kDouble);
      ZeroOptimizer opt(net.ptr(), borrowed(pg), adamw(), small_buckets(stage));
      for (int s = 0; s < 3; ++s) {
        opt.zero_grad();
        for (auto& p : net->parameters()) p.mutable_grad().reset();
        const int64_t from = s * kGlobal + pg.rank() * (kGlobal / 2);
        opt.pre_forward();
        torch::mse_loss(net->forward(inputs(from, kGlobal / 2).to(torch::kDouble)),
                        targets(from, kGlobal / 2).to(torch::kDouble))
            .backward();
        opt.step();
      }
      got[pg.rank()] = params_of(*net);
    });
    for (int r = 0; r < 2; ++r) EXPECT_LT(rel_error(got[r], want), 1e-9) << "stage " << static_cast<int>(stage);
  }
}

// A non-finite gradient on one rank: every rank skips the step, the scale
// backs off, and nothing moves; a clean step after it moves all alike.
TEST(ZeroScaler, InfOnOneRankSkipsTheStepEverywhere) {
  for (ZeroStage stage : {ZeroStage::One, ZeroStage::Two})
    run_ranks(3, "shm", [&](cohort::ProcessGroup& pg) {
      torch::set_num_threads(1);
      Net net;
      ZeroOptimizer opt(net.ptr(), borrowed(pg), adamw(), small_buckets(stage));
      cohort::torch::GradScaler scaler({.init_scale = 1024.0});
      const auto before = params_of(*net);
      opt.zero_grad();
      opt.pre_forward();
      auto x = inputs(pg.rank() * 8, 8);
      if (pg.rank() == 1) x[0][0] = std::numeric_limits<float>::infinity();
      scaler.scale(torch::mse_loss(net->forward(x), targets(pg.rank() * 8, 8))).backward();
      EXPECT_FALSE(opt.step(scaler)) << "rank " << pg.rank();
      EXPECT_EQ(scaler.current_scale(), 512.0);
      EXPECT_EQ(rel_error(params_of(*net), before), 0.0);
      opt.zero_grad();
      opt.pre_forward();
      scaler.scale(torch::mse_loss(net->forward(inputs(pg.rank() * 8, 8)), targets(pg.rank() * 8, 8))).backward();
      EXPECT_TRUE(opt.step(scaler));
      EXPECT_GT(rel_error(params_of(*net), before), 0.0);
    });
}

// Each rank's optimizer state is 1/N of the whole, within 1% (the padding).
TEST(ZeroMemory, OptimizerStateIsOneNthPerRank) {
  struct Wide : torch::nn::Module {
    Wide() {
      a = register_module("a", torch::nn::Linear(300, 301));
      b = register_module("b", torch::nn::Linear(301, 7));
    }
    torch::Tensor forward(torch::Tensor x) { return b->forward(torch::relu(a->forward(x))); }
    torch::nn::Linear a{nullptr}, b{nullptr};
  };
  for (int world : {2, 3, 4})
    run_ranks(world, "shm", [&](cohort::ProcessGroup& pg) {
      torch::set_num_threads(1);
      auto net = std::make_shared<Wide>();
      ZeroOptimizer opt(net, borrowed(pg), adamw(), {.bucket_cap_mb = 0.1});
      opt.zero_grad();
      opt.pre_forward();
      net->forward(torch::ones({2, 300})).sum().backward();
      opt.step();
      const auto m = opt.memory();
      const size_t n_params = 300 * 301 + 301 + 301 * 7 + 7;
      EXPECT_EQ(m.params, n_params);
      EXPECT_EQ(m.padded % world, 0u);
      EXPECT_EQ(m.shard * world, m.padded);
      const double full_state = 2.0 * sizeof(float) * n_params;  // exp_avg and exp_avg_sq
      EXPECT_NEAR(m.optimizer_state_bytes, full_state / world, 0.01 * full_state / world) << "world " << world;
      EXPECT_EQ(m.grad_shard_bytes, m.shard * sizeof(float));
    });
}

// ZeRO-2 never holds the whole gradient: each .grad is freed once it is in
// its bucket, and the buckets share grad_buffers buffers (backward fills them
// in plan order), against ZeRO-1's full replica of buckets.
TEST(ZeroMemory, Zero2HoldsAFewBucketsNotTheWholeGradient) {
  struct Deep : torch::nn::Module {
    Deep() {
      for (char i = '0'; i < '8'; ++i) layers.push_back(register_module({'l', i}, torch::nn::Linear(64, 64)));
    }
    torch::Tensor forward(torch::Tensor x) {
      for (size_t i = 0; i < layers.size(); ++i) {
        x = torch::tanh(layers[i]->forward(x));
        // Runs in backward once the gradients of layers i+1.. exist (autograd
        // accumulates them before it goes on): how many are still held?
        if (i == 3 && x.requires_grad())
          x.register_hook([this](torch::Tensor g) {
            held_mid_backward = 0;
            for (size_t j = 4; j < layers.size(); ++j) held_mid_backward += layers[j]->weight.grad().defined();
            return g;
          });
      }
      return x;
    }
    std::vector<torch::nn::Linear> layers;
    int held_mid_backward = -1;
  };
  const size_t grad_bytes = 8 * (64 * 64 + 64) * sizeof(float);
  for (bool device : {false, true}) {  // the host path, then the device path on the CPU
    DeviceModeOnCpu path(device);
    for (int world : {2, 3})
      run_ranks(world, "shm", [&](cohort::ProcessGroup& pg) {
        torch::set_num_threads(1);
        for (ZeroStage stage : {ZeroStage::One, ZeroStage::Two}) {
          torch::manual_seed(3);
          auto net = std::make_shared<Deep>();
          // About one layer per bucket: 8 buckets or more.
          ZeroOptimizer opt(net, borrowed(pg), adamw(), {.stage = stage, .bucket_cap_mb = 0.015, .first_bucket_mb = 0.015});
          for (int s = 0; s < 3; ++s) {
            opt.zero_grad();
            opt.pre_forward();
            net->forward(torch::full({4, 64}, 0.1 * (pg.rank() + s + 1))).sum().backward();
            // ZeRO-1's are views of its buckets; ZeRO-2 frees each once copied.
            EXPECT_EQ(net->held_mid_backward, stage == ZeroStage::One ? 4 : 0) << "step " << s;
            for (const auto& p : net->parameters())
              EXPECT_TRUE(stage == ZeroStage::One || !p.grad().defined()) << "a gradient outlived its bucket";
            opt.step();
          }
          const auto m = opt.memory();
          if (stage == ZeroStage::One) {
            EXPECT_GE(m.grad_bytes, grad_bytes);
            continue;
          }
          size_t biggest = 0;
          for (const auto& b : opt.ddp().reducer().plan()) biggest = std::max(biggest, (b.bytes() + 63) / 64 * 64);
          EXPECT_GE(opt.ddp().reducer().plan().size(), 8u);
          EXPECT_EQ(m.grad_bytes, 2 * biggest) << "world " << world;
          EXPECT_LT(m.grad_bytes, grad_bytes / 3) << "world " << world;
        }
      });
  }
}

// Steps [from, to) of the global-batch schedule with an existing optimizer (float64).
void zero_steps(ZeroOptimizer& opt, Net& net, const cohort::ProcessGroup& pg, int from, int to) {
  const int64_t local = kGlobal / pg.size();
  for (int s = from; s < to; ++s) {
    opt.zero_grad();
    opt.pre_forward();
    const int64_t at = s * kGlobal + pg.rank() * local;
    torch::mse_loss(net->forward(inputs(at, local).to(torch::kDouble)), targets(at, local).to(torch::kDouble)).backward();
    opt.step();
  }
}

// A ZeRO run at `world` ranks (float64): 5 steps, the state saved (every
// rank's shard, rank 0's module), 5 more steps; `want` is rank 0's parameters at the end.
struct SavedRun {
  std::vector<std::vector<cohort::NamedTensor>> shards;
  std::vector<cohort::NamedTensor> model_state;
  std::vector<torch::Tensor> want;
};
SavedRun save_mid_run(int world, ZeroStage stage, const cohort::torch::ShardOptimizerOptions& optim) {
  SavedRun r;
  r.shards.resize(world);
  run_ranks(world, "shm", [&](cohort::ProcessGroup& pg) {
    torch::set_num_threads(1);
    Net net;
    net->to(torch::kDouble);
    ZeroOptimizer opt(net.ptr(), borrowed(pg), optim, small_buckets(stage));
    zero_steps(opt, net, pg, 0, 5);
    r.shards[pg.rank()] = opt.state_shard();
    if (pg.rank() == 0) r.model_state = cohort::torch::module_state(*net);
    zero_steps(opt, net, pg, 5, 10);
    if (pg.rank() == 0) r.want = params_of(*net);
  });
  return r;
}

// State saved at world 4 after 5 steps, loaded at worlds 4, 3, 2 and 1 (each
// a different padding and chunking), continues exactly as the run that
// never stopped; for both stages and SGD with momentum as well as AdamW.
TEST(ZeroCheckpoint, StateSavedAtWorld4ReshardsToAnyWorld) {
  for (ZeroStage stage : {ZeroStage::One, ZeroStage::Two})
    for (bool sgd : {false, true}) {
      const cohort::torch::ShardOptimizerOptions optim =
          sgd ? cohort::torch::ShardOptimizerOptions(torch::optim::SGDOptions(0.05).momentum(0.9))
              : cohort::torch::ShardOptimizerOptions(adamw());
      const auto [shards, model_state, want] = save_mid_run(4, stage, optim);
      for (int world : {4, 3, 2, 1}) {
        std::vector<std::vector<torch::Tensor>> got(world);
        run_ranks(world, "shm", [&](cohort::ProcessGroup& pg) {
          torch::set_num_threads(1);
          Net net;
          net->to(torch::kDouble);
          cohort::torch::load_module_state(*net, model_state);
          ZeroOptimizer opt(net.ptr(), borrowed(pg), optim, small_buckets(stage));
          std::set<int> read;
          opt.load_state_shards([&](int k) {
            read.insert(k);
            return shards.at(k);
          });
          if (world == 4) {
            EXPECT_EQ(read, (std::set<int>{0, pg.rank()})) << "a rank reads only what it needs";
          }
          zero_steps(opt, net, pg, 5, 10);
          got[pg.rank()] = params_of(*net);
        });
        for (int r = 0; r < world; ++r)
          EXPECT_LT(rel_error(got[r], want), 1e-9)
              << "ZeRO-" << static_cast<int>(stage) << (sgd ? " SGD" : " AdamW") << " at world " << world << " rank " << r;
      }
    }
}

// The device path (on the CPU) writes the state the host path writes and
// reads it: saved at world 3 on one path, resumed at world 2 on the other,
// continues as the run that never stopped, for both stages.
TEST(ZeroCheckpoint, TheDevicePathSavesAndLoadsTheHostPathsState) {
  for (ZeroStage stage : {ZeroStage::One, ZeroStage::Two})
    for (bool saved_on_device : {true, false}) {
      SavedRun saved;
      {
        DeviceModeOnCpu path(saved_on_device);
        saved = save_mid_run(3, stage, adamw());
      }
      DeviceModeOnCpu path(!saved_on_device);
      std::vector<std::vector<torch::Tensor>> got(2);
      run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
        torch::set_num_threads(1);
        Net net;
        net->to(torch::kDouble);
        cohort::torch::load_module_state(*net, saved.model_state);
        ZeroOptimizer opt(net.ptr(), borrowed(pg), adamw(), small_buckets(stage));
        opt.load_state_shards([&](int k) { return saved.shards.at(k); });
        zero_steps(opt, net, pg, 5, 10);
        got[pg.rank()] = params_of(*net);
      });
      for (int r = 0; r < 2; ++r)
        EXPECT_LT(rel_error(got[r], saved.want), 1e-9)
            << "ZeRO-" << static_cast<int>(stage) << " saved on the " << (saved_on_device ? "device" : "host")
            << " path, rank " << r;
    }
}

// Steps [from, to) of one process on the global batch with LibTorch's AdamW (float64).
void plain_steps(torch::optim::AdamW& opt, Net& net, int from, int to) {
  for (int s = from; s < to; ++s) {
    opt.zero_grad();
    torch::mse_loss(net->forward(inputs(s * kGlobal, kGlobal).to(torch::kDouble)),
                    targets(s * kGlobal, kGlobal).to(torch::kDouble))
        .backward();
    opt.step();
  }
}

// A sharded state (world 3) gathered into LibTorch's AdamW, and LibTorch's
// state cut into shards (world 2): either continues as the run that wrote it.
TEST(ZeroCheckpoint, ShardedAndPlainStateLoadIntoEachOther) {
  for (ZeroStage stage : {ZeroStage::One, ZeroStage::Two}) {
    const auto [shards, model_state, want] = save_mid_run(3, stage, adamw());
    {
      Net net;
      net->to(torch::kDouble);
      cohort::torch::load_module_state(*net, model_state);
      torch::optim::AdamW opt(net->parameters(), adamw());
      cohort::torch::load_optimizer_state(opt, cohort::torch::zero_state_to_full(*net, [&](int k) { return shards.at(k); }));
      plain_steps(opt, net, 5, 10);
      EXPECT_LT(rel_error(params_of(*net), want), 1e-9) << "gathered, ZeRO-" << static_cast<int>(stage);
    }
    // The other way: one process's LibTorch AdamW state, continued under ZeRO at world 2.
    Net plain;
    plain->to(torch::kDouble);
    torch::optim::AdamW plain_opt(plain->parameters(), adamw());
    plain_steps(plain_opt, plain, 0, 5);
    const auto full = cohort::torch::optimizer_state(plain_opt);
    const auto plain_model = cohort::torch::module_state(*plain);
    plain_steps(plain_opt, plain, 5, 10);
    const auto want_plain = params_of(*plain);
    run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
      torch::set_num_threads(1);
      Net net;
      net->to(torch::kDouble);
      cohort::torch::load_module_state(*net, plain_model);
      ZeroOptimizer opt(net.ptr(), borrowed(pg), adamw(), small_buckets(stage));
      opt.load_full_state(full);
      zero_steps(opt, net, pg, 5, 10);
      EXPECT_LT(rel_error(params_of(*net), want_plain), 1e-9) << "cut into shards, ZeRO-" << static_cast<int>(stage);
    });
  }
}

TEST(ZeroCheckpoint, ALayoutThatDoesNotFitIsRefusedAndChangesNothing) {
  std::vector<cohort::NamedTensor> saved;
  run_ranks(1, "shm", [&](cohort::ProcessGroup& pg) {
    Net net;
    ZeroOptimizer opt(net.ptr(), borrowed(pg), adamw(), small_buckets(ZeroStage::Two));
    opt.zero_grad();
    opt.pre_forward();
    torch::mse_loss(net->forward(inputs(0, 4)), targets(0, 4)).backward();
    opt.step();
    saved = opt.state_shard();
  });
  run_ranks(1, "shm", [&](cohort::ProcessGroup& pg) {
    const auto expect_refused = [&](ZeroOptimizer& opt, const std::vector<cohort::NamedTensor>& shard,
                                    const std::string& words) {
      try {
        opt.load_state_shards([&](int) { return shard; });
        ADD_FAILURE() << "no error; expected one naming: " << words;
      } catch (const cohort::InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
      }
      EXPECT_EQ(cohort::torch::optimizer_state_bytes(opt.shard_optimizer()), 0u) << "nothing was loaded";
    };
    Net net;
    ZeroOptimizer other_buckets(net.ptr(), borrowed(pg), adamw(), {.bucket_cap_mb = 25});
    expect_refused(other_buckets, saved, "buckets");
    Net net2;
    ZeroOptimizer sgd(net2.ptr(), borrowed(pg), torch::optim::SGDOptions(0.1).momentum(0.9), small_buckets(ZeroStage::Two));
    expect_refused(sgd, saved, "holds AdamW state, this optimizer is SGD");
    Net net3;
    ZeroOptimizer same(net3.ptr(), borrowed(pg), adamw(), small_buckets(ZeroStage::Two));
    auto truncated = saved;
    truncated.front().bytes.resize(truncated.front().bytes.size() / 2);
    truncated.front().shape = {static_cast<int64_t>(truncated.front().bytes.size() / sizeof(float))};
    expect_refused(same, truncated, "the layout says");
    expect_refused(same, {}, "zero.layout");
  });
}

TEST(ZeroErrors, BadInputIsNamed) {
  run_ranks(1, "shm", [&](cohort::ProcessGroup& pg) {
    Net net;
    auto expect_throw = [&](auto&& make, const std::string& words) {
      try {
        make();
        ADD_FAILURE() << "no error; expected one naming: " << words;
      } catch (const cohort::InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
      }
    };
    expect_throw([&] { ZeroOptimizer(nullptr, borrowed(pg), adamw()); }, "module is null");
    expect_throw([&] { ZeroOptimizer(net.ptr(), nullptr, adamw()); }, "process group is null");
    expect_throw([&] { ZeroOptimizer(net.ptr(), borrowed(pg), adamw(), {.stage = static_cast<ZeroStage>(3)}); },
                 "stage 3 does not exist");
    expect_throw(
        [&] { ZeroOptimizer(net.ptr(), borrowed(pg), adamw(), {.stage = ZeroStage::One, .find_unused_parameters = true}); },
        "find_unused_parameters is for ZeRO-2");
    ZeroOptions no_buffers;
    no_buffers.grad_buffers = 0;
    expect_throw([&] { ZeroOptimizer(net.ptr(), borrowed(pg), adamw(), no_buffers); }, "grad_buffers is 0");
    expect_throw([&] { ZeroOptimizer(net.ptr(), borrowed(pg), torch::optim::AdamWOptions(-1.0)); },
                 "learning rate must be");
    {
      // A reused bucket buffer needs its collective finished on the host;
      // wait_on_stream would only order a stream after it.
      cohort::torch::DistributedDataParallelOptions d;
      d.recycled_buckets = 2;
      d.wait_on_stream = true;
      d.comm_hook = [](cohort::ddp::GradBucket& b) -> cohort::ddp::CommFuture { return {b.allreduce({}), [] {}}; };
      expect_throw([&] { cohort::torch::DistributedDataParallel(net.ptr(), borrowed(pg), d); },
                   "HINT: leave wait_on_stream off");
    }
    ZeroOptimizer opt(net.ptr(), borrowed(pg), adamw());
    expect_throw([&] { opt.clip_grad_norm(0); }, "max_norm must be");
    expect_throw([&] { opt.set_lr(std::nan("")); }, "learning rate must be");
    opt.zero_grad();
    opt.pre_forward();
    {
      auto guard = opt.no_sync();
      torch::mse_loss(net->forward(inputs(0, 4)), targets(0, 4)).backward();
    }
    expect_throw([&] { opt.step(); }, "ran under no_sync()");
  });
}

// ---- Param groups ----

// The biases in a second group: no weight decay, half the learning rate.
torch::optim::AdamWOptions no_decay() { return torch::optim::AdamWOptions(5e-3).weight_decay(0.0); }
const std::vector<std::string> kBiases = {"fc1.bias", "fc2.bias"};
double lr_at(int step) { return 1e-2 * (1.0 - 0.04 * step); }  // a schedule, through set_lr

// Caps (in float64) that put fc2.bias, fc2.weight and fc1.bias into one
// bucket (the groups 1, 0, 1) and fc1.weight into a second.
ZeroOptions grouped(ZeroStage stage, cohort::torch::ShardOptimizerOptions options,
                    std::vector<std::string> names = kBiases) {
  ZeroOptions o;
  o.stage = stage;
  o.bucket_cap_mb = 0.001;
  o.first_bucket_mb = 0.001;
  o.param_groups = {{std::move(names), std::move(options)}};
  return o;
}

// One process, LibTorch's AdamW with the same two groups, on the global batch.
std::vector<torch::Tensor> grouped_reference(int steps) {
  Net net;
  net->to(torch::kDouble);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{net->fc1->weight, net->fc2->weight},
                      std::make_unique<torch::optim::AdamWOptions>(adamw()));
  groups.emplace_back(std::vector<torch::Tensor>{net->fc1->bias, net->fc2->bias},
                      std::make_unique<torch::optim::AdamWOptions>(no_decay()));
  torch::optim::AdamW opt(std::move(groups), adamw());
  for (int s = 0; s < steps; ++s) {
    opt.param_groups()[0].options().set_lr(lr_at(s));
    opt.param_groups()[1].options().set_lr(lr_at(s) / 2);
    opt.zero_grad();
    torch::mse_loss(net->forward(inputs(s * kGlobal, kGlobal).to(torch::kDouble)),
                    targets(s * kGlobal, kGlobal).to(torch::kDouble))
        .backward();
    opt.step();
  }
  return params_of(*net);
}

// Each group steps with its own options and set_lr keeps their ratio, at
// every world size: the chunks cut the buckets, and so the groups, at other
// places for each (a bucket's chunk may hold parameters of both groups).
TEST(ZeroGroups, TwoGroupsEqualOneProcessWithTheSameGroups) {
  const auto want = grouped_reference(20);
  for (ZeroStage stage : {ZeroStage::One, ZeroStage::Two})
    for (int world : {1, 2, 3, 4}) {
      std::vector<std::vector<torch::Tensor>> got(world);
      run_ranks(world, "shm", [&](cohort::ProcessGroup& pg) {
        torch::set_num_threads(1);
        Net net;
        net->to(torch::kDouble);
        ZeroOptimizer opt(net.ptr(), borrowed(pg), adamw(), grouped(stage, no_decay()));
        const auto& groups = opt.shard_optimizer().param_groups();
        ASSERT_EQ(groups.size(), 2u);
        if (world == 1) {
          size_t runs = groups[0].params().size() + groups[1].params().size();
          EXPECT_EQ(opt.ddp().reducer().plan().size(), 2u);
          EXPECT_EQ(runs, 4u) << "the first bucket is three runs: a bias, a weight, a bias";
        }
        const int64_t local = kGlobal / world;
        for (int s = 0; s < 20; ++s) {
          opt.set_lr(lr_at(s));
          EXPECT_DOUBLE_EQ(groups[1].options().get_lr(), lr_at(s) / 2);
          opt.zero_grad();
          opt.pre_forward();
          const int64_t at = s * kGlobal + pg.rank() * local;
          torch::mse_loss(net->forward(inputs(at, local).to(torch::kDouble)), targets(at, local).to(torch::kDouble))
              .backward();
          opt.step();
        }
        got[pg.rank()] = params_of(*net);
      });
      for (int r = 0; r < world; ++r)
        EXPECT_LT(rel_error(got[r], want), 1e-9) << "ZeRO-" << static_cast<int>(stage) << " x " << world << " rank " << r;
    }
}

// Groups that keep different state, saved at world 4 and resumed at 3, 2 and
// 1 with the same groups, as the run that never stopped:
//   - SGD with momentum, and a group without (which keeps no state at all):
//     the biases; or fc2 whole, so that rank 0's chunk of the first bucket
//     holds that group only while rank 3's holds both (every rank must still
//     save the same fields, zeros where a group keeps none);
//   - AdamW, and a group with amsgrad (max_exp_avg_sq) for fc2.
TEST(ZeroGroups, StateOfGroupsReshards) {
  using cohort::torch::ShardOptimizerOptions;
  struct Setup {
    const char* what;
    ShardOptimizerOptions main, group;
    std::vector<std::string> names;
  };
  const std::vector<Setup> setups = {
      {"SGD, biases without momentum", torch::optim::SGDOptions(0.05).momentum(0.9), torch::optim::SGDOptions(0.02),
       kBiases},
      {"SGD, fc2 without momentum", torch::optim::SGDOptions(0.05).momentum(0.9), torch::optim::SGDOptions(0.02),
       {"fc2.weight", "fc2.bias"}},
      {"AdamW, fc2 with amsgrad", adamw(), torch::optim::AdamWOptions(5e-3).amsgrad(true), {"fc2.weight", "fc2.bias"}},
  };
  for (const Setup& setup : setups) {
    const ZeroOptions opts = grouped(ZeroStage::Two, setup.group, setup.names);
    std::vector<std::vector<cohort::NamedTensor>> shards(4);
    std::vector<cohort::NamedTensor> model_state;
    std::vector<torch::Tensor> want;
    run_ranks(4, "shm", [&](cohort::ProcessGroup& pg) {
      torch::set_num_threads(1);
      Net net;
      net->to(torch::kDouble);
      ZeroOptimizer opt(net.ptr(), borrowed(pg), setup.main, opts);
      zero_steps(opt, net, pg, 0, 5);
      shards[pg.rank()] = opt.state_shard();
      if (pg.rank() == 0) model_state = cohort::torch::module_state(*net);
      zero_steps(opt, net, pg, 5, 10);
      if (pg.rank() == 0) want = params_of(*net);
    });
    std::set<std::string> names0;
    for (const auto& t : shards[0]) names0.insert(t.name);
    for (int r = 1; r < 4; ++r) {
      std::set<std::string> names;
      for (const auto& t : shards[r]) names.insert(t.name);
      EXPECT_EQ(names, names0) << setup.what << ": rank " << r << " saves other tensors than rank 0";
    }
    for (int world : {3, 2, 1}) {
      std::vector<std::vector<torch::Tensor>> got(world);
      run_ranks(world, "shm", [&](cohort::ProcessGroup& pg) {
        torch::set_num_threads(1);
        Net net;
        net->to(torch::kDouble);
        cohort::torch::load_module_state(*net, model_state);
        ZeroOptimizer opt(net.ptr(), borrowed(pg), setup.main, opts);
        opt.load_state_shards([&](int k) { return shards.at(k); });
        zero_steps(opt, net, pg, 5, 10);
        got[pg.rank()] = params_of(*net);
      });
      for (int r = 0; r < world; ++r)
        EXPECT_LT(rel_error(got[r], want), 1e-9) << setup.what << ", world " << world << " rank " << r;
    }
  }
}

// LibTorch's AdamW over a Net with the biases in a second group (no_decay), at constant learning rates.
std::unique_ptr<torch::optim::AdamW> plain_grouped(Net& net) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{net->fc1->weight, net->fc2->weight},
                      std::make_unique<torch::optim::AdamWOptions>(adamw()));
  groups.emplace_back(std::vector<torch::Tensor>{net->fc1->bias, net->fc2->bias},
                      std::make_unique<torch::optim::AdamWOptions>(no_decay()));
  return std::make_unique<torch::optim::AdamW>(std::move(groups), adamw());
}

// A grouped optimizer's state moves between one process and ZeRO named by
// parameter (tp::full_optimizer_state; no tensor-parallel layers here, so no
// communication): one process's, 5 steps in, continues under ZeRO with the
// same groups at world 2, and ZeRO's (world 3, gathered by position) in one
// process with the groups; each as the one process that never stopped.
// optimizer_state() of the grouped optimizer names positions in each group,
// not parameters: refused, naming the way that works, changing nothing.
TEST(ZeroGroups, AGroupedPlainStateMovesByName) {
  Net plain;
  plain->to(torch::kDouble);
  const auto opt = plain_grouped(plain);
  plain_steps(*opt, plain, 0, 5);
  const auto model = cohort::torch::module_state(*plain);
  const auto named = cohort::torch::tp::full_optimizer_state(*plain, *opt);
  const auto positional = cohort::torch::optimizer_state(*opt);
  plain_steps(*opt, plain, 5, 10);
  const auto want = params_of(*plain);
  for (ZeroStage stage : {ZeroStage::One, ZeroStage::Two}) {
    const std::string what = "ZeRO-" + std::to_string(static_cast<int>(stage));
    std::vector<std::vector<torch::Tensor>> got(2);
    run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
      torch::set_num_threads(1);
      Net net;
      net->to(torch::kDouble);
      cohort::torch::load_module_state(*net, model);
      ZeroOptimizer zero(net.ptr(), borrowed(pg), adamw(), grouped(stage, no_decay()));
      try {
        zero.load_full_state(positional);
        ADD_FAILURE() << what << ": a grouped state by position was taken";
      } catch (const cohort::InvalidArgument& e) {
        EXPECT_TRUE(std::string(e.what()).find("HINT: save it named by parameter") != std::string::npos) << e.what();
      }
      EXPECT_EQ(cohort::torch::optimizer_state_bytes(zero.shard_optimizer()), 0u) << "a refused load installed state";
      zero.load_full_state(named);
      zero_steps(zero, net, pg, 5, 10);
      got[pg.rank()] = params_of(*net);
    });
    for (int r = 0; r < 2; ++r) EXPECT_LT(rel_error(got[r], want), 1e-9) << what << " rank " << r;
  }
  // The other way: ZeRO with the groups at world 3, 5 steps, gathered by position into one process's groups.
  std::vector<std::vector<cohort::NamedTensor>> shards(3);
  std::vector<cohort::NamedTensor> zero_model;
  run_ranks(3, "shm", [&](cohort::ProcessGroup& pg) {
    torch::set_num_threads(1);
    Net net;
    net->to(torch::kDouble);
    ZeroOptimizer zero(net.ptr(), borrowed(pg), adamw(), grouped(ZeroStage::Two, no_decay()));
    zero_steps(zero, net, pg, 0, 5);
    shards[pg.rank()] = zero.state_shard();
    if (pg.rank() == 0) zero_model = cohort::torch::module_state(*net);
  });
  Net resumed;
  resumed->to(torch::kDouble);
  cohort::torch::load_module_state(*resumed, zero_model);
  const auto resumed_opt = plain_grouped(resumed);
  const auto full = cohort::torch::zero_state_to_full(*resumed, [&](int k) { return shards.at(k); });
  try {  // positions in two groups say nothing about which parameter: refused here too
    cohort::torch::tp::load_full_optimizer_state(*resumed, *resumed_opt, positional);
    ADD_FAILURE() << "a grouped state by position was taken";
  } catch (const cohort::InvalidArgument& e) {
    EXPECT_TRUE(std::string(e.what()).find("belongs to a second param group") != std::string::npos) << e.what();
  }
  EXPECT_TRUE(resumed_opt->state().empty()) << "a refused load installed state";
  cohort::torch::tp::load_full_optimizer_state(*resumed, *resumed_opt, full);
  plain_steps(*resumed_opt, resumed, 5, 10);
  EXPECT_LT(rel_error(params_of(*resumed), want), 1e-9) << "ZeRO's state in one process with the groups";
}

// How ZeRO and FSDP read a state named by parameter: only "group<g>.lr" and
// "group<g>.param<k>.<field>" are positional (a submodule may be called
// "group_norm"), a tensor registered twice (tied weights) has its state at
// its first place, a state of learning rates only (saved before any step)
// holds nothing, and what cannot be read is named.
TEST(ZeroGroups, StateByNameFindsEveryParameter) {
  struct Tied : torch::nn::Module {
    Tied() {
      register_module("group_norm", torch::nn::Linear(2, 3));
      torch::nn::Linear shared(2, 2);
      register_module("a", shared);
      register_module("b", shared);
    }
  } m;
  namespace shard = cohort::torch::shard;
  const shard::TrainablePlaces places = shard::trainable_places(m);
  ASSERT_EQ(places.names.size(), 6u);  // group_norm.weight, .bias, a.weight, a.bias, b.weight, b.bias
  EXPECT_EQ(places.first, (std::vector<size_t>{0, 1, 2, 3, 2, 3}));
  using cohort::torch::to_named;
  const auto one = torch::ones({1}, torch::kDouble);
  const std::vector<cohort::NamedTensor> by_name = {
      to_named("group0.lr", one), to_named("group1.lr", one), to_named("group_norm.weight.exp_avg", torch::ones({3, 2})),
      to_named("group_norm.weight.step", one), to_named("b.bias.exp_avg", torch::ones({2}))};
  std::vector<std::string> got;
  for (const auto& t : shard::plain_state_by_position(by_name, places, "test")) got.push_back(t.name);
  EXPECT_EQ(got, (std::vector<std::string>{"group0.param0.exp_avg", "group0.param0.step", "group0.param3.exp_avg"}));
  EXPECT_TRUE(shard::plain_state_by_position({to_named("group0.lr", one), to_named("group1.lr", one)}, places, "test")
                  .empty());
  auto error_of = [&](std::vector<cohort::NamedTensor> state) {
    try {
      (void)shard::plain_state_by_position(state, places, "test");
    } catch (const cohort::InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const auto x = torch::ones({2});
  EXPECT_NE(error_of({to_named("group0.param0.exp_avg", x), to_named("a.bias.exp_avg", x)}).find("both by position and by name"),
            std::string::npos);
  EXPECT_NE(error_of({to_named("c.weight.exp_avg", x)}).find("no trainable parameter \"c.weight\""), std::string::npos);
  EXPECT_NE(error_of({to_named("a.bias.velocity", x)}).find("is not a parameter's optimizer state"), std::string::npos);
  EXPECT_NE(error_of({to_named("group0.param0.exp_avg", x), to_named("group1.lr", one)}).find("second param group"),
            std::string::npos);
}

TEST(ZeroGroups, BadGroupsAreNamed) {
  run_ranks(1, "shm", [&](cohort::ProcessGroup& pg) {
    const auto expect_throw = [&](std::vector<cohort::torch::ZeroParamGroup> groups, const std::string& words) {
      Net net;
      ZeroOptions o;
      o.param_groups = std::move(groups);
      try {
        ZeroOptimizer opt(net.ptr(), borrowed(pg), adamw(), o);
        ADD_FAILURE() << "no error; expected one naming: " << words;
      } catch (const cohort::InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
      }
    };
    expect_throw({{{"fc1.bias", "fc3.bias"}, no_decay()}}, "names 'fc3.bias', which is not a trainable parameter");
    expect_throw({{{"fc1.bias"}, no_decay()}, {{"fc2.bias", "fc1.bias"}, no_decay()}},
                 "param group 2 names 'fc1.bias', which param group 1 names already");
    expect_throw({{{"fc1.bias"}, torch::optim::SGDOptions(0.1)}}, "param group 1 is SGD, the optimizer is AdamW");
    expect_throw({{{}, no_decay()}}, "param group 1 names no parameter");
    expect_throw({{{"fc1.bias"}, torch::optim::AdamWOptions(-1.0)}}, "param group 1: the learning rate must be");
    Net net;
    ZeroOptions o;
    o.param_groups = {{{"fc1.bias"}, no_decay()}};
    try {
      ZeroOptimizer opt(net.ptr(), borrowed(pg), torch::optim::AdamWOptions(0.0), o);
      ADD_FAILURE() << "a first group at lr 0 with a second above it was taken";
    } catch (const cohort::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("which 0 does not define"), std::string::npos) << e.what();
    }
  });
}

// Sequences that would lose gradients or count them twice are refused by name.
TEST(ZeroErrors, GradientsThatWouldBeLostAreRefused) {
  const auto expect_throw = [](auto&& call, const std::string& words) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one naming: " << words;
    } catch (const cohort::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  for (ZeroStage stage : {ZeroStage::One, ZeroStage::Two})
    run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
      Net net;
      ZeroOptimizer opt(net.ptr(), borrowed(pg), adamw(), small_buckets(stage));
      const auto backward = [&] {
        opt.pre_forward();
        torch::mse_loss(net->forward(inputs(pg.rank() * 4, 4)), targets(pg.rank() * 4, 4)).backward();
      };
      opt.zero_grad();
      backward();
      opt.step();
      backward();  // no zero_grad() in between
      expect_throw([&] { opt.step(); }, "before zero_grad()");
      opt.zero_grad();
      backward();
      if (stage == ZeroStage::Two) {  // a synced backward, then one under no_sync: the last was never reduced
        {
          auto guard = opt.no_sync();
          backward();
        }
        expect_throw([&] { opt.step(); }, "ran under no_sync()");
        backward();  // synced: reduces what no_sync accumulated too
      }
      opt.step();
      // set to none, a backward that is abandoned, then zero_grad: the gradients are zeros again
      // (ZeRO-1's bucket views) or none (ZeRO-2 frees each once it is in a bucket)
      opt.zero_grad();
      for (auto& p : net->parameters()) p.mutable_grad().reset();
      backward();
      opt.zero_grad();
      for (auto& p : net->parameters()) {
        if (stage == ZeroStage::Two) EXPECT_FALSE(p.grad().defined());
        else EXPECT_EQ(p.grad().abs().sum().item<double>(), 0.0);
      }
    });
}

// A replica that differs is named by DistributedDataParallel's check, before anything moves.
TEST(ZeroErrors, DifferentModelsAreNamed) {
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    std::shared_ptr<torch::nn::Module> m = pg.rank() == 0 ? Net().ptr() : Net(/*with_unused=*/true).ptr();
    try {
      ZeroOptimizer opt(m, borrowed(pg), adamw());
      ADD_FAILURE() << "rank " << pg.rank() << ": no error";
    } catch (const cohort::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("different parameters than rank 0"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
