// FullyShardedDataParallel: after every step the gathered parameters are
// those of one process training on the whole global batch; each rank keeps
// 1/N of them; units are gathered only while they compute; sharded state
// reshards across world sizes; bad input is named. Ranks run as threads over
// a MemoryStore.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <set>

#include "cohort/torch.hpp"
#include "cohort/torch_fsdp.hpp"
#include "cohort/torch_tensor_parallel.hpp"
#include "cohort/torch_train.hpp"
#include "test_util.hpp"
#include "torch/ddp_test_model.hpp"
#include "torch/device_mode.hpp"

namespace {

using cohort::testing::run_ranks;
using cohort::torch::FsdpUnit;
using cohort::torch::FullyShardedDataParallel;
using ddp_test::borrowed;
using ddp_test::DeviceModeOnCpu;
using ddp_test::inputs;
using ddp_test::targets;
using torch::nn::Linear;

constexpr int64_t kGlobal = 24;  // divides by 1, 2, 3 and 4

// Linear(in, out) with deterministic weights: sin(0.37 k) / 2 for the k-th
// element in the model's parameter order (no shared random generator between
// thread-ranks). Set as each layer is built, so that a unit is complete when
// its FsdpUnit is (FsdpShardedInit shards it there).
Linear det_linear(int64_t in, int64_t out, int& k) {
  Linear l(in, out);
  torch::NoGradGuard g;
  for (auto& p : l->parameters()) {
    auto flat = p.view({-1});
    for (int64_t i = 0; i < flat.numel(); ++i) flat[i] = std::sin(0.37 * (k++)) * 0.5;
  }
  return l;
}

// A block with a unit inside it (nested units).
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int& k) {
    inner = register_module("inner", std::make_shared<FsdpUnit<Linear>>(det_linear(7, 7, k)));
    out = register_module("out", det_linear(7, 8, k));
  }
  torch::Tensor forward(torch::Tensor x) { return out->forward(torch::tanh(inner->forward(x))); }
  std::shared_ptr<FsdpUnit<Linear>> inner;
  Linear out{nullptr};
};
TORCH_MODULE(Block);

// Units: in (8 -> 7, 63 elements: padded at worlds 2 and 4), block (its
// inner unit nested), a second plain unit; the head stays in the root unit.
struct FNetImpl : torch::nn::Module {
  FNetImpl() {
    int k = 0;
    in = register_module("in", std::make_shared<FsdpUnit<Linear>>(det_linear(8, 7, k)));
    block = register_module("block", std::make_shared<FsdpUnit<Block>>(Block(k)));
    mid = register_module("mid", std::make_shared<FsdpUnit<Linear>>(det_linear(8, 8, k)));
    head = register_module("head", det_linear(8, 4, k));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::tanh(in->forward(x));
    x = torch::tanh(block->forward(x));
    x = torch::tanh(mid->forward(x));
    return head->forward(x);
  }
  std::shared_ptr<FsdpUnit<Linear>> in, mid;
  std::shared_ptr<FsdpUnit<Block>> block;
  Linear head{nullptr};
};
TORCH_MODULE(FNet);

torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.1); }

std::map<std::string, torch::Tensor> by_name(const std::vector<cohort::NamedTensor>& state) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& t : state) out[t.name] = cohort::torch::from_named(t);
  return out;
}

// Largest |a - b| / max(|b|, 1e-3) over every element of every tensor `want` names.
double rel_error(const std::map<std::string, torch::Tensor>& got, const std::map<std::string, torch::Tensor>& want) {
  double worst = 0;
  for (const auto& [name, b] : want) {
    const auto it = got.find(name);
    if (it == got.end()) {
      ADD_FAILURE() << "missing " << name;
      return 1e9;
    }
    worst = std::max(worst, ((it->second.to(b.scalar_type()) - b).abs() / b.abs().clamp_min(1e-3)).max().item<double>());
  }
  return worst;
}

// One process, LibTorch's AdamW, the whole global batch (FsdpUnit without an FSDP is the plain module).
std::map<std::string, torch::Tensor> reference(torch::ScalarType type, int steps, int micro = 1, double clip = 0) {
  FNet net;
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
  return by_name(cohort::torch::module_state(*net));
}

struct Train {
  torch::ScalarType type = torch::kDouble;
  int steps = 1, micro = 1;
  bool no_sync = false;  // every micro-batch but the last under no_sync()
  double clip = 0;
  bool fused = false;    // cohort::torch::adamw_step instead of opt.step()
  bool optimizer_zero_grad = false;  // LibTorch's opt.zero_grad() (.grad set to none) instead of fsdp.zero_grad()
  int prefetch = 1;
  bool cpu_offload = false;  // FsdpOptions::cpu_offload (the device path only)
};

// Steps [from, to) of the schedule on an existing FSDP; returns each step's
// loss on the global batch (the mean of the ranks' losses).
std::vector<double> fsdp_steps(FullyShardedDataParallel& fsdp, torch::optim::AdamW& opt, FNet& net, const Train& t,
                               int from, int to) {
  const int world = fsdp.group().size(), rank = fsdp.group().rank();
  const int64_t local = kGlobal / world;
  std::vector<double> losses;
  for (int s = from; s < to; ++s) {
    if (t.optimizer_zero_grad) cohort::torch::zero_grad(opt);  // .grad set to none (LibTorch 1.13 would zero in place)
    else fsdp.zero_grad();
    for (int m = 0; m < t.micro; ++m) {
      const int64_t at = (s * t.micro + m) * kGlobal + rank * local;
      fsdp.pre_forward();
      auto loss = torch::mse_loss(net->forward(inputs(at, local).to(t.type)), targets(at, local).to(t.type));
      if (m == 0) losses.push_back(cohort::torch::allreduce_scalar(fsdp.group(), loss.item<double>()) / world);
      if (t.no_sync && m + 1 < t.micro) {
        auto guard = fsdp.no_sync();
        loss.backward();
      } else {
        loss.backward();
      }
    }
    if (t.clip > 0) fsdp.clip_grad_norm(t.clip);
    if (t.fused) cohort::torch::adamw_step(opt);
    else opt.step();
  }
  return losses;
}

std::vector<std::map<std::string, torch::Tensor>> train_fsdp(int world, const Train& t) {
  std::vector<std::map<std::string, torch::Tensor>> out(world);
  run_ranks(world, "shm", [&](cohort::ProcessGroup& pg) {
    torch::set_num_threads(1);
    FNet net;
    net->to(t.type);
    FullyShardedDataParallel fsdp(net.ptr(), borrowed(pg), {.prefetch = t.prefetch, .cpu_offload = t.cpu_offload});
    torch::optim::AdamW opt(fsdp.parameters(), adamw());
    fsdp_steps(fsdp, opt, net, t, 0, t.steps);
    out[pg.rank()] = by_name(fsdp.full_state());
  });
  return out;
}

template <class F>
void expect_invalid(F&& call, const std::string& words) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one naming: " << words;
  } catch (const cohort::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

// A world size, on the host path or the device path (DeviceModeOnCpu: the
// code a module on a GPU runs, with the CPU as the device).
struct Case {
  int world = 1;
  bool device = false;
};
void PrintTo(const Case& c, std::ostream* os) { *os << "world " << c.world << (c.device ? ", device path" : ", host path"); }
std::vector<Case> cases() {
  std::vector<Case> out;
  for (int world : {1, 2, 3, 4}) out.push_back({world, false});
  for (int world : {1, 3}) out.push_back({world, true});
  return out;
}

class Fsdp : public ::testing::TestWithParam<Case> {
 protected:
  const int world = GetParam().world;
  DeviceModeOnCpu path{GetParam().device};
};

// The bar: AdamW over 100 steps, 1e-6 relative (float64: the
// reduction order is the only difference).
TEST_P(Fsdp, AdamW100StepsEqualOneProcessOnTheGlobalBatch) {
  const auto want = reference(torch::kDouble, 100);
  const auto got = train_fsdp(world, {.type = torch::kDouble, .steps = 100});
  for (int r = 0; r < world; ++r) EXPECT_LT(rel_error(got[r], want), 1e-6) << "rank " << r;
}

// float32 with the fused AdamW on the shards; LibTorch's step is the reference.
TEST_P(Fsdp, Float32WithTheFusedStepIsCloseToOneProcess) {
  const auto want = reference(torch::kFloat, 30);
  const auto got = train_fsdp(world, {.type = torch::kFloat, .steps = 30, .fused = true});
  for (int r = 0; r < world; ++r) EXPECT_LT(rel_error(got[r], want), 1e-4) << "rank " << r;
}

TEST_P(Fsdp, AccumulatesMicroBatchesSyncedOrUnderNoSync) {
  const auto want = reference(torch::kDouble, 5, 3);
  for (bool no_sync : {false, true}) {
    const auto got = train_fsdp(world, {.type = torch::kDouble, .steps = 5, .micro = 3, .no_sync = no_sync});
    for (int r = 0; r < world; ++r) EXPECT_LT(rel_error(got[r], want), 1e-9) << "rank " << r << " no_sync " << no_sync;
  }
}

TEST_P(Fsdp, ClipsByTheGlobalNormWithAnyPrefetch) {
  const auto want = reference(torch::kDouble, 10, 1, 0.05);  // small enough to clip every step
  for (int prefetch : {0, 1, 3}) {
    const auto got = train_fsdp(world, {.type = torch::kDouble, .steps = 10, .clip = 0.05, .prefetch = prefetch});
    for (int r = 0; r < world; ++r) EXPECT_LT(rel_error(got[r], want), 1e-9) << "rank " << r << " prefetch " << prefetch;
  }
}

// LibTorch's own zero_grad() on the optimizer sets the shards' .grad to none;
// the next reduction clears and re-attaches them: the same training.
TEST_P(Fsdp, TheOptimizersZeroGradWorksAsFsdpsOwn) {
  const auto want = reference(torch::kDouble, 10);
  const auto got = train_fsdp(world, {.type = torch::kDouble, .steps = 10, .optimizer_zero_grad = true});
  for (int r = 0; r < world; ++r) EXPECT_LT(rel_error(got[r], want), 1e-9) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Worlds, Fsdp, ::testing::ValuesIn(cases()), [](const auto& info) {
  return "np" + std::to_string(info.param.world) + (info.param.device ? "_device" : "");
});

// Each rank keeps 1/N of every unit; outside a unit's forward and backward
// its parameters hold no memory, and at most a few units are whole at once.
TEST(FsdpMemory, ShardsAreOneNthAndUnitsAreFreedAfterUse) {
  for (bool device : {false, true}) {
  SCOPED_TRACE(device ? "device path" : "host path");
  DeviceModeOnCpu path(device);
  run_ranks(4, "shm", [&](cohort::ProcessGroup& pg) {
    torch::set_num_threads(1);
    FNet net;
    FullyShardedDataParallel fsdp(net.ptr(), borrowed(pg));
    const auto m = fsdp.memory();
    const size_t n_params = 8 * 7 + 7 + 7 * 7 + 7 + 7 * 8 + 8 + 8 * 8 + 8 + 8 * 4 + 4;
    EXPECT_EQ(m.params, n_params);
    EXPECT_EQ(m.units, 5u);  // root, in, block, block.inner, mid
    EXPECT_EQ(m.shard * 4, m.padded);
    EXPECT_LT(m.padded, n_params + 5 * 4);
    const auto freed = [&](const std::string& prefix) {
      for (const auto& p : net->named_parameters())
        if (p.key().rfind(prefix, 0) == 0 && p.value().storage().nbytes() != 0) return false;
      return true;
    };
    EXPECT_TRUE(freed("in.") && freed("mid.") && freed("block.") && freed("head."));
    torch::optim::AdamW opt(fsdp.parameters(), adamw());
    for (int s = 0; s < 3; ++s) {
      fsdp.zero_grad();
      fsdp.pre_forward();
      EXPECT_FALSE(freed("head.")) << "the root unit is gathered by pre_forward()";
      auto y = net->forward(inputs(pg.rank() * 6, 6));
      EXPECT_TRUE(freed("in.") && freed("mid.") && freed("block.")) << "units freed after their forward";
      torch::mse_loss(y, targets(pg.rank() * 6, 6)).backward();
      EXPECT_TRUE(freed("in.") && freed("mid.") && freed("block.")) << "every unit freed after backward";
      EXPECT_FALSE(freed("head.")) << "the root unit stays until the next pre_forward()";
      for (const auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined()) << "whole gradients dropped";
      opt.step();
    }
    // The pool: the unit that runs, the prefetched one, two reductions in
    // flight at most; and the root unit's own buffer.
    const size_t root = (8 * 4 + 4 + 3) / 4 * 4;
    EXPECT_LE(fsdp.memory().gather_bytes, 4 * m.largest_unit * sizeof(float) + root * sizeof(float) + 5 * 64);
  });
  }
}

// Built under FsdpShardedInit, each unit is sharded as soon as it exists
// (rank 0's values: rank 1 starts from others), and trains as the whole model.
TEST(FsdpShardedInit, UnitsAreShardedAsTheyAreBuiltAndTrainTheSame) {
  const auto want = reference(torch::kFloat, 10);
  for (bool device : {false, true}) {
  SCOPED_TRACE(device ? "device path" : "host path");
  DeviceModeOnCpu path(device);
  std::vector<std::map<std::string, torch::Tensor>> got(3);
  run_ranks(3, "shm", [&](cohort::ProcessGroup& pg) {
    torch::set_num_threads(1);
    std::shared_ptr<FNetImpl> net;
    {
      cohort::torch::FsdpShardedInit sharded(borrowed(pg));
      net = std::make_shared<FNetImpl>();
      if (pg.rank() == 1) {  // only the root unit's values still live here, and they are broadcast by FSDP
        torch::NoGradGuard g;
        net->head->weight.fill_(7.0);
      }
    }
    for (const auto& p : net->named_parameters())
      if (p.key().rfind("head.", 0) != 0) {
        EXPECT_EQ(p.value().storage().nbytes(), 0u) << p.key() << " is whole";
      }
    FullyShardedDataParallel fsdp(net, borrowed(pg));
    torch::optim::AdamW opt(fsdp.parameters(), adamw());
    FNet holder(net);
    fsdp_steps(fsdp, opt, holder, {.type = torch::kFloat}, 0, 10);
    got[pg.rank()] = by_name(fsdp.full_state());
  });
  for (int r = 0; r < 3; ++r) EXPECT_LT(rel_error(got[r], want), 1e-4) << "rank " << r;
  }
  // An FSDP on a group of another size than the one the units were sharded for is refused.
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    std::shared_ptr<FNetImpl> net;
    {
      cohort::torch::FsdpShardedInit sharded(borrowed(pg));
      net = std::make_shared<FNetImpl>();
    }
    std::vector<std::shared_ptr<cohort::ProcessGroup>> mine;
    for (int r = 0; r < 2; ++r) {
      auto g = pg.new_group({r});
      if (g) mine.push_back(g);
    }
    expect_invalid([&] { FullyShardedDataParallel f(net, mine.front()); }, "was sharded at construction as rank");
  });
}

// Mixed precision: units gathered and computing in bf16, the shards (master
// weights), their gradients and the optimizer state in float32. Close to the
// float32 run (bf16 keeps 8 bits of mantissa), and the state is float32.
TEST(FsdpMixedPrecision, Bf16ComputeOnFloat32MasterShards) {
  const auto want = reference(torch::kFloat, 20);
  for (bool device : {false, true}) {
  SCOPED_TRACE(device ? "device path" : "host path");
  DeviceModeOnCpu path(device);
  std::vector<std::map<std::string, torch::Tensor>> got(2);
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    torch::set_num_threads(1);
    FNet net;
    FullyShardedDataParallel fsdp(net.ptr(), borrowed(pg), {.param_dtype = torch::kBFloat16});
    for (const auto& p : fsdp.parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat) << "master shards";
    for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), torch::kBFloat16) << "compute copies";
    torch::optim::AdamW opt(fsdp.parameters(), adamw());
    const int64_t local = kGlobal / 2;
    for (int s = 0; s < 20; ++s) {
      fsdp.zero_grad();
      fsdp.pre_forward();
      const int64_t at = s * kGlobal + pg.rank() * local;
      auto x = inputs(at, local).to(torch::kBFloat16);  // the root computes last here; units cast their inputs
      torch::mse_loss(net->forward(x).to(torch::kFloat), targets(at, local)).backward();
      for (const auto& p : fsdp.parameters()) EXPECT_EQ(p.grad().scalar_type(), torch::kFloat);
      cohort::torch::adamw_step(opt);
    }
    got[pg.rank()] = by_name(fsdp.full_state());
    for (const auto& [name, t] : got[pg.rank()]) EXPECT_EQ(t.scalar_type(), torch::kFloat) << name;
  });
  for (int r = 0; r < 2; ++r) {
    double worst = 0;
    for (const auto& [name, w] : want) worst = std::max(worst, (got[r].at(name) - w).abs().max().item<double>());
    EXPECT_LT(worst, 2e-2) << "rank " << r;  // lr 1e-2 x 20 steps moves weights by ~0.2; bf16 rounding stays well below
    EXPECT_GT(worst, 0.0) << "bf16 compute should differ from float32 somewhere";
  }
  EXPECT_EQ(rel_error(got[0], got[1]), 0.0) << "every rank holds the same parameters";
  }
}

// Evaluation under NoGradGuard gathers and frees the same way, and gives
// the same output on every rank as the whole model.
TEST(FsdpEval, ForwardWithoutGradientsMatchesTheWholeModel) {
  FNet ref;
  const auto want = ref->forward(inputs(0, 5));
  run_ranks(3, "shm", [&](cohort::ProcessGroup& pg) {
    torch::set_num_threads(1);
    FNet net;
    FullyShardedDataParallel fsdp(net.ptr(), borrowed(pg));
    torch::NoGradGuard no_grad;
    for (int i = 0; i < 2; ++i) {
      fsdp.pre_forward();
      EXPECT_TRUE(torch::allclose(net->forward(inputs(0, 5)), want)) << "rank " << pg.rank();
    }
  });
}

// How a test builds the AdamW of an FSDP: over its parameters() (ungrouped)
// or over its parameter_groups() (`grouped`, with the param groups below).
using MakeOptimizer = std::function<std::unique_ptr<torch::optim::AdamW>(FullyShardedDataParallel&)>;
std::unique_ptr<torch::optim::AdamW> ungrouped(FullyShardedDataParallel& fsdp) {
  return std::make_unique<torch::optim::AdamW>(fsdp.parameters(), adamw());
}

// The saved state of a world-4 run after 5 steps (model and optimizer
// shards of every rank) and rank 0's full state after 10.
struct SavedRun {
  std::vector<std::vector<cohort::NamedTensor>> model, optim;
  std::map<std::string, torch::Tensor> want;
  std::vector<double> losses;  // steps 5 to 9 on the global batch
};
SavedRun save_mid_run(int world, const MakeOptimizer& make = ungrouped) {
  SavedRun r;
  r.model.resize(world);
  r.optim.resize(world);
  run_ranks(world, "shm", [&](cohort::ProcessGroup& pg) {
    torch::set_num_threads(1);
    FNet net;
    net->to(torch::kDouble);
    FullyShardedDataParallel fsdp(net.ptr(), borrowed(pg));
    const auto made = make(fsdp);
    torch::optim::AdamW& opt = *made;
    fsdp_steps(fsdp, opt, net, {}, 0, 5);
    r.model[pg.rank()] = fsdp.state_shard();
    r.optim[pg.rank()] = fsdp.optimizer_state_shard(opt);
    const auto losses = fsdp_steps(fsdp, opt, net, {}, 5, 10);
    const auto full = by_name(fsdp.full_state());
    if (pg.rank() == 0) {
      r.want = full;
      r.losses = losses;
    }
  });
  return r;
}

// Steps [5, 10) at `world` of an FSDP whose optimizer `make` builds, after
// `load` put the saved state into both: rank 0's losses and every rank's
// full state, checked by expect_resumed against the run that never stopped.
struct Resumed {
  std::vector<double> losses;
  std::vector<std::map<std::string, torch::Tensor>> state;
};
using LoadState = std::function<void(FullyShardedDataParallel&, torch::optim::AdamW&)>;
Resumed resume_in_fsdp(int world, const MakeOptimizer& make, const LoadState& load) {
  Resumed r;
  r.state.resize(world);
  run_ranks(world, "shm", [&](cohort::ProcessGroup& pg) {
    torch::set_num_threads(1);
    FNet net;
    net->to(torch::kDouble);
    FullyShardedDataParallel fsdp(net.ptr(), borrowed(pg));
    const auto opt = make(fsdp);
    load(fsdp, *opt);
    const auto losses = fsdp_steps(fsdp, *opt, net, {}, 5, 10);
    r.state[pg.rank()] = by_name(fsdp.full_state());
    if (pg.rank() == 0) r.losses = losses;
  });
  return r;
}
void expect_resumed(const Resumed& got, const std::vector<double>& losses, const std::map<std::string, torch::Tensor>& want,
                    double loss_tol, double param_tol, const std::string& what) {
  ASSERT_EQ(got.losses.size(), 5u) << what;
  ASSERT_EQ(losses.size(), 5u) << what;
  for (size_t s = 0; s < 5; ++s)
    EXPECT_NEAR(got.losses[s], losses[s], loss_tol * std::abs(losses[s])) << what << " step " << s + 5;
  for (size_t r = 0; r < got.state.size(); ++r) EXPECT_LT(rel_error(got.state[r], want), param_tol) << what << " rank " << r;
}

// Saved at world 4, resumed at 4, 3, 2 and 1: the same losses and
// parameters as the run that never stopped (each world a different chunking
// and padding; the global batch is the same).
TEST(FsdpCheckpoint, ShardsSavedAtWorld4ResumeAtAnyWorld) {
  const SavedRun saved = save_mid_run(4);
  ASSERT_EQ(saved.losses.size(), 5u);
  for (int world : {4, 3, 2, 1}) {
    const Resumed got = resume_in_fsdp(world, ungrouped, [&](FullyShardedDataParallel& fsdp, torch::optim::AdamW& opt) {
      fsdp.load_state_shards([&](int k) { return saved.model.at(k); });
      fsdp.load_optimizer_state_shards(opt, [&](int k) { return saved.optim.at(k); });
    });
    expect_resumed(got, saved.losses, saved.want, 1e-6, 1e-12, "world " + std::to_string(world));
  }
}

// Model and optimizer shards written on the device path (a module on a GPU)
// resume on the host path and the other way round, at another world size:
// the files do not depend on where the module trained.
TEST(FsdpCheckpoint, TheDevicePathSavesAndLoadsTheHostPathsState) {
  for (bool saved_on_device : {true, false}) {
    SavedRun saved;
    {
      DeviceModeOnCpu path(saved_on_device);
      saved = save_mid_run(2);
    }
    DeviceModeOnCpu path(!saved_on_device);
    const Resumed got = resume_in_fsdp(3, ungrouped, [&](FullyShardedDataParallel& fsdp, torch::optim::AdamW& opt) {
      fsdp.load_state_shards([&](int k) { return saved.model.at(k); });
      fsdp.load_optimizer_state_shards(opt, [&](int k) { return saved.optim.at(k); });
    });
    expect_resumed(got, saved.losses, saved.want, 1e-6, 1e-12,
                   saved_on_device ? "saved on the device path" : "saved on the host path");
  }
}

// cpu_offload on the device path: the shards, their gradients and the
// optimizer's state are host memory, each gather copies the chunk up and
// each reduction's chunk comes down; the training is the same (with
// clipping, micro-batches under no_sync, mixed precision), and its state
// saves and resumes into an FSDP without offload. (With the CPU as the
// device, host and device memory are the same: this runs the offload's
// code, the in-place gathers and the host zeroing, but cannot tell whether
// the shards really live elsewhere; FsdpCuda.CpuOffloadEqualsOneProcess in
// ddp_cuda_test does, on a GPU.)
TEST(FsdpOffload, TrainsAsOneProcessAndItsStateResumesWithoutIt) {
  DeviceModeOnCpu path(true);
  const auto want = reference(torch::kDouble, 10, 1, 0.05);
  auto got = train_fsdp(3, {.type = torch::kDouble, .steps = 10, .clip = 0.05, .cpu_offload = true});
  for (int r = 0; r < 3; ++r) EXPECT_LT(rel_error(got[r], want), 1e-9) << "rank " << r;
  const auto accumulated = reference(torch::kDouble, 4, 3);
  got = train_fsdp(2, {.type = torch::kDouble, .steps = 4, .micro = 3, .no_sync = true, .cpu_offload = true});
  for (int r = 0; r < 2; ++r) EXPECT_LT(rel_error(got[r], accumulated), 1e-9) << "rank " << r << " under no_sync";

  std::vector<std::vector<cohort::NamedTensor>> model(2), optim(2);
  std::vector<std::map<std::string, torch::Tensor>> mixed(2);
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    torch::set_num_threads(1);
    FNet net;
    net->to(torch::kDouble);
    FullyShardedDataParallel fsdp(net.ptr(), borrowed(pg), {.cpu_offload = true});
    for (const auto& p : fsdp.parameters()) EXPECT_TRUE(p.device().is_cpu() && p.grad().device().is_cpu());
    torch::optim::AdamW opt(fsdp.parameters(), adamw());
    fsdp_steps(fsdp, opt, net, {}, 0, 5);
    model[pg.rank()] = fsdp.state_shard();
    optim[pg.rank()] = fsdp.optimizer_state_shard(opt);
  });
  const SavedRun plain = save_mid_run(2);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(rel_error(by_name(model[r]), by_name(plain.model[r])), 0.0) << "the same model shard, rank " << r;
    EXPECT_LT(rel_error(by_name(optim[r]), by_name(plain.optim[r])), 1e-12) << "the same optimizer shard, rank " << r;
  }
  const Resumed resumed = resume_in_fsdp(3, ungrouped, [&](FullyShardedDataParallel& fsdp, torch::optim::AdamW& opt) {
    fsdp.load_state_shards([&](int k) { return model.at(k); });
    fsdp.load_optimizer_state_shards(opt, [&](int k) { return optim.at(k); });
  });
  expect_resumed(resumed, plain.losses, plain.want, 1e-6, 1e-12, "offloaded state resumed at world 3");

  // bf16 gathers of host master shards.
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    torch::set_num_threads(1);
    FNet net;
    FullyShardedDataParallel fsdp(net.ptr(), borrowed(pg), {.param_dtype = torch::kBFloat16, .cpu_offload = true});
    torch::optim::AdamW opt(fsdp.parameters(), adamw());
    const int64_t local = kGlobal / 2;
    for (int s = 0; s < 5; ++s) {
      fsdp.zero_grad();
      fsdp.pre_forward();
      const int64_t at = s * kGlobal + pg.rank() * local;
      torch::mse_loss(net->forward(inputs(at, local).to(torch::kBFloat16)).to(torch::kFloat), targets(at, local)).backward();
      opt.step();
    }
    mixed[pg.rank()] = by_name(fsdp.full_state());
  });
  const auto want_mixed = reference(torch::kFloat, 5);
  for (int r = 0; r < 2; ++r)
    for (const auto& [name, w] : want_mixed) EXPECT_LT((mixed[r].at(name) - w).abs().max().item<double>(), 2e-2) << name;
}

// full_state() is the unwrapped model's module_state(); it loads into an
// FSDP at another world size, and into the plain model.
TEST(FsdpCheckpoint, FullStateIsThePlainModelsState) {
  FNet plain;
  plain->to(torch::kDouble);
  std::vector<cohort::NamedTensor> full;
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    torch::set_num_threads(1);
    FNet net;
    net->to(torch::kDouble);
    FullyShardedDataParallel fsdp(net.ptr(), borrowed(pg));
    torch::optim::AdamW opt(fsdp.parameters(), adamw());
    fsdp_steps(fsdp, opt, net, {}, 0, 3);
    auto state = fsdp.full_state();
    if (pg.rank() == 0) full = state;
  });
  cohort::torch::load_module_state(*plain, full);  // the names and shapes of the plain model
  EXPECT_EQ(rel_error(by_name(cohort::torch::module_state(*plain)), by_name(full)), 0.0);
  run_ranks(3, "shm", [&](cohort::ProcessGroup& pg) {
    torch::set_num_threads(1);
    FNet net;
    net->to(torch::kDouble);
    FullyShardedDataParallel fsdp(net.ptr(), borrowed(pg));
    fsdp.load_full_state(full);
    EXPECT_EQ(rel_error(by_name(fsdp.full_state()), by_name(full)), 0.0) << "rank " << pg.rank();
  });
}

// Steps [from, to) of one process on the global batch (`micro` of them per
// step, their gradients summed, as fsdp_steps takes them); each step's first loss.
std::vector<double> plain_steps(FNet& net, torch::optim::Optimizer& opt, int from, int to, int micro = 1) {
  std::vector<double> losses;
  for (int s = from; s < to; ++s) {
    opt.zero_grad();
    for (int m = 0; m < micro; ++m) {
      const int64_t at = (s * micro + m) * kGlobal;
      auto loss = torch::mse_loss(net->forward(inputs(at, kGlobal).to(torch::kDouble)),
                                  targets(at, kGlobal).to(torch::kDouble));
      if (m == 0) losses.push_back(loss.item<double>());
      loss.backward();
    }
    opt.step();
  }
  return losses;
}

// FSDP's shards (world 4) resume in one process without FSDP, and that
// process's plain state resumes in FSDP at world 3: both continue as the run
// that never stopped.
TEST(FsdpCheckpoint, ShardsResumeWithoutFsdpAndAPlainStateResumesWithIt) {
  const SavedRun saved = save_mid_run(4);
  FNet plain;
  plain->to(torch::kDouble);
  torch::optim::AdamW opt(plain->parameters(), adamw());
  cohort::torch::load_module_state(*plain, cohort::torch::fsdp_state_to_full(*plain, [&](int k) { return saved.model.at(k); }));
  cohort::torch::load_optimizer_state(
      opt, cohort::torch::fsdp_optimizer_state_to_full(*plain, [&](int k) { return saved.optim.at(k); }));
  const auto plain_model = cohort::torch::module_state(*plain);
  const auto plain_optim = cohort::torch::optimizer_state(opt);
  const auto losses = plain_steps(plain, opt, 5, 10);
  for (size_t s = 0; s < 5; ++s) EXPECT_NEAR(losses[s], saved.losses[s], 1e-6 * std::abs(saved.losses[s])) << "step " << s + 5;
  EXPECT_LT(rel_error(by_name(cohort::torch::module_state(*plain)), saved.want), 1e-6);

  const Resumed got = resume_in_fsdp(3, ungrouped, [&](FullyShardedDataParallel& fsdp, torch::optim::AdamW& o) {
    fsdp.load_full_state(plain_model);
    fsdp.load_full_optimizer_state(o, plain_optim);
  });
  expect_resumed(got, saved.losses, saved.want, 1e-6, 1e-6, "plain state in FSDP at world 3:");

  // The wrong files, or another model, are named.
  expect_invalid([&] { (void)cohort::torch::fsdp_optimizer_state_to_full(*plain, [&](int k) { return saved.model.at(k); }); },
                 "holds the model");
  expect_invalid([&] { (void)cohort::torch::fsdp_state_to_full(*plain, [&](int k) { return saved.optim.at(k); }); },
                 "hold optimizer state");
  ddp_test::Net other;
  expect_invalid([&] { (void)cohort::torch::fsdp_state_to_full(*other, [&](int k) { return saved.model.at(k); }); },
                 "FSDP units");
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    FNet net;
    net->to(torch::kDouble);
    FullyShardedDataParallel fsdp(net.ptr(), borrowed(pg));
    torch::optim::SGD sgd(fsdp.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    expect_invalid([&] { fsdp.load_full_optimizer_state(sgd, plain_optim); }, "this optimizer is SGD");
  });
}

// A model with what FSDP keeps whole on every rank: a BatchNorm's running
// statistics (buffers that training changes) and a frozen layer.
struct NormNetImpl : torch::nn::Module {
  NormNetImpl() {
    int k = 0;
    in = register_module("in", std::make_shared<FsdpUnit<Linear>>(det_linear(8, 7, k)));
    norm = register_module("norm", torch::nn::BatchNorm1d(7));
    fixed = register_module("fixed", det_linear(7, 7, k));
    head = register_module("head", det_linear(7, 4, k));
    for (auto& p : fixed->parameters()) p.requires_grad_(false);
  }
  torch::Tensor forward(torch::Tensor x) {
    return head->forward(torch::tanh(fixed->forward(norm->forward(torch::tanh(in->forward(x))))));
  }
  std::shared_ptr<FsdpUnit<Linear>> in;
  torch::nn::BatchNorm1d norm{nullptr};
  Linear fixed{nullptr}, head{nullptr};
};
TORCH_MODULE(NormNet);

// Rank 0's buffers and frozen parameters go into its shard file and come
// back at another world size, and without FSDP: a resumed BatchNorm keeps
// its running statistics instead of starting them again.
TEST(FsdpCheckpoint, BuffersAndFrozenParametersAreSavedAndResumed) {
  std::vector<std::vector<cohort::NamedTensor>> files(2);
  std::map<std::string, torch::Tensor> want;  // rank 0's whole state when it saved
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    torch::set_num_threads(1);
    NormNet net;
    net->to(torch::kDouble);
    {
      torch::NoGradGuard g;
      net->fixed->weight.fill_(0.25);  // not what a fresh model has
    }
    FullyShardedDataParallel fsdp(net.ptr(), borrowed(pg));
    torch::optim::AdamW opt(fsdp.parameters(), adamw());
    const int64_t local = kGlobal / 2;
    for (int s = 0; s < 3; ++s) {
      fsdp.zero_grad();
      fsdp.pre_forward();
      const int64_t at = s * kGlobal + pg.rank() * local;
      torch::mse_loss(net->forward(inputs(at, local).to(torch::kDouble)), targets(at, local).to(torch::kDouble)).backward();
      opt.step();
    }
    files[pg.rank()] = fsdp.state_shard();
    auto full = by_name(fsdp.full_state());
    if (pg.rank() == 0) want = full;
  });
  ASSERT_EQ(want.at("norm.num_batches_tracked").item<int64_t>(), 3);
  ASSERT_EQ(want.at("fixed.weight").max().item<double>(), 0.25);
  for (const auto& t : files[1]) EXPECT_EQ(t.name.rfind("fsdp.whole.", 0), std::string::npos) << "rank 1 saved " << t.name;
  const auto read = [&](int k) { return files.at(k); };

  run_ranks(3, "shm", [&](cohort::ProcessGroup& pg) {
    torch::set_num_threads(1);
    NormNet net;
    net->to(torch::kDouble);
    FullyShardedDataParallel fsdp(net.ptr(), borrowed(pg));
    fsdp.load_state_shards(read);
    EXPECT_EQ(rel_error(by_name(fsdp.full_state()), want), 0.0) << "rank " << pg.rank();
  });
  NormNet plain;
  plain->to(torch::kDouble);
  cohort::torch::load_module_state(*plain, cohort::torch::fsdp_state_to_full(*plain, read));
  EXPECT_EQ(rel_error(by_name(cohort::torch::module_state(*plain)), want), 0.0);

  // A saved buffer of another shape, or one the model lacks: named, and nothing changes.
  auto reshaped = files;
  for (auto& t : reshaped[0])
    if (t.name == "fsdp.whole.norm.running_mean") t = cohort::torch::to_named(t.name, torch::zeros({5}, torch::kDouble));
  auto extra = files;
  extra[0].push_back(cohort::torch::to_named("fsdp.whole.norm.spare", torch::zeros({7}, torch::kDouble)));
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    NormNet net;
    net->to(torch::kDouble);
    FullyShardedDataParallel fsdp(net.ptr(), borrowed(pg));
    const auto before = by_name(fsdp.full_state());
    expect_invalid([&] { fsdp.load_state_shards([&](int k) { return reshaped.at(k); }); },
                   "'norm.running_mean' is Double [5] in the checkpoint");
    expect_invalid([&] { fsdp.load_state_shards([&](int k) { return extra.at(k); }); }, "e.g. 'norm.spare'");
    EXPECT_EQ(rel_error(by_name(fsdp.full_state()), before), 0.0) << "rank " << pg.rank();
  });
  expect_invalid([&] { (void)cohort::torch::fsdp_state_to_full(*plain, [&](int k) { return extra.at(k); }); },
                 "this model does not");

  // Files written before the whole tensors were saved (no "fsdp.whole"):
  // they load, and the module keeps its own.
  auto older = files;
  std::erase_if(older[0], [](const cohort::NamedTensor& t) { return t.name.rfind("fsdp.whole", 0) == 0; });
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    NormNet net;
    net->to(torch::kDouble);
    FullyShardedDataParallel fsdp(net.ptr(), borrowed(pg));
    fsdp.load_state_shards([&](int k) { return older.at(k); });
    const auto got = by_name(fsdp.full_state());
    EXPECT_EQ(got.at("norm.num_batches_tracked").item<int64_t>(), 0) << "rank " << pg.rank();
    EXPECT_EQ(rel_error(got, {{"in.weight", want.at("in.weight")}}), 0.0);
  });
}

// A layout that is not this model's is refused, and nothing changes.
TEST(FsdpCheckpoint, AShardLayoutThatDoesNotFitIsRefusedAndChangesNothing) {
  const SavedRun saved = save_mid_run(2);
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    torch::set_num_threads(1);
    ddp_test::Net other;  // no units, other sizes
    other->to(torch::kDouble);
    FullyShardedDataParallel fsdp(other.ptr(), borrowed(pg));
    const auto before = by_name(fsdp.full_state());
    expect_invalid([&] { fsdp.load_state_shards([&](int k) { return saved.model.at(k); }); }, "FSDP units");
    EXPECT_EQ(rel_error(by_name(fsdp.full_state()), before), 0.0);
    FNet net;
    net->to(torch::kDouble);
    FullyShardedDataParallel mine(net.ptr(), borrowed(pg));
    torch::optim::SGD sgd(mine.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    expect_invalid([&] { mine.load_optimizer_state_shards(sgd, [&](int k) { return saved.optim.at(k); }); },
                   "holds AdamW state, this optimizer is SGD");
    expect_invalid([&] { mine.load_optimizer_state_shards(sgd, [&](int k) { return saved.model.at(k); }); },
                   "no \"fsdp.optimizer\"");
    auto truncated = saved.model;
    for (auto& rank_files : truncated) {
      rank_files.front().bytes.resize(rank_files.front().bytes.size() / 2);
      rank_files.front().shape = {static_cast<int64_t>(rank_files.front().bytes.size() / sizeof(double))};
    }
    expect_invalid([&] { mine.load_state_shards([&](int k) { return truncated.at(k); }); }, "the layout says");
    expect_invalid([&] { mine.load_state_shards([&](int) { return std::vector<cohort::NamedTensor>{}; }); },
                   "fsdp.layout");
    torch::optim::AdamW foreign(net->parameters(), adamw());
    expect_invalid([&] { (void)mine.optimizer_state_shard(foreign); }, "not over this FSDP's parameters()");
    expect_invalid([&] { mine.load_full_state(cohort::torch::module_state(*ddp_test::Net())); }, "no tensor for parameter");
    expect_invalid([&] { (void)cohort::torch::module_state(*net); }, "HINT: save fsdp.full_state()");
  });
}

// ---- Param groups (parameter_groups) ----

// The biases of FNet (in every unit, the root's head included).
std::vector<std::string> bias_names() {
  std::vector<std::string> out;
  FNet net;
  for (const auto& item : net->named_parameters())
    if (item.key().size() > 5 && item.key().substr(item.key().size() - 5) == ".bias") out.push_back(item.key());
  return out;
}
torch::optim::AdamWOptions no_decay() { return torch::optim::AdamWOptions(5e-3).weight_decay(0.0); }

// An AdamW over two groups: everything but the biases with adamw(), the
// biases with `biases`.
std::unique_ptr<torch::optim::AdamW> grouped_adamw(std::vector<torch::Tensor> rest, std::vector<torch::Tensor> biases,
                                                   const torch::optim::AdamWOptions& for_biases = no_decay()) {
  std::vector<torch::optim::OptimizerParamGroup> g;
  g.emplace_back(std::move(rest), std::make_unique<torch::optim::AdamWOptions>(adamw()));
  g.emplace_back(std::move(biases), std::make_unique<torch::optim::AdamWOptions>(for_biases));
  return std::make_unique<torch::optim::AdamW>(std::move(g), adamw());
}

// The same two groups over an FSDP (its parameter_groups()) and over a plain FNet.
std::unique_ptr<torch::optim::AdamW> grouped(FullyShardedDataParallel& fsdp) {
  const auto groups = fsdp.parameter_groups({bias_names()});
  return grouped_adamw(groups.at(0), groups.at(1));
}
std::unique_ptr<torch::optim::AdamW> plain_grouped(FNet& net) {
  const auto biases = bias_names();
  std::vector<torch::Tensor> rest, bias;
  for (const auto& item : net->named_parameters())
    (std::count(biases.begin(), biases.end(), item.key()) ? bias : rest).push_back(item.value());
  return grouped_adamw(rest, bias);
}

// Every parameter's state of `from` into `to`, an optimizer over the same
// tensors grouped otherwise: LibTorch keys the state by tensor, not by group.
void copy_state(torch::optim::Optimizer& from, torch::optim::Optimizer& to) {
  for (const auto& [key, state] : from.state()) to.state()[key] = state->clone();
}

// The biases without weight decay at half the learning rate, in every unit,
// at worlds 2, 3 and 4 (each cuts the units' chunks at other places), with
// FSDP's zero_grad and with the optimizer's (which sets the runs' .grad to
// none): LibTorch's AdamW with the same groups in one process.
TEST(FsdpGroups, TwoGroupsEqualOneProcessWithTheSameGroups) {
  const auto biases = bias_names();
  ASSERT_EQ(biases.size(), 5u);
  std::map<std::string, torch::Tensor> want;
  {
    FNet net;
    net->to(torch::kDouble);
    plain_steps(net, *plain_grouped(net), 0, 10);
    want = by_name(cohort::torch::module_state(*net));
  }
  for (int world : {2, 3, 4})
    for (bool optimizer_zero_grad : {false, true}) {
      std::vector<std::map<std::string, torch::Tensor>> got(world);
      run_ranks(world, "shm", [&](cohort::ProcessGroup& pg) {
        torch::set_num_threads(1);
        FNet net;
        net->to(torch::kDouble);
        FullyShardedDataParallel fsdp(net.ptr(), borrowed(pg));
        auto groups = fsdp.parameter_groups({biases});
        ASSERT_EQ(groups.size(), 2u);
        auto opt = grouped_adamw(groups[0], groups[1]);
        Train t;
        t.optimizer_zero_grad = optimizer_zero_grad;
        fsdp_steps(fsdp, *opt, net, t, 0, 10);
        got[pg.rank()] = by_name(fsdp.full_state());
      });
      for (int r = 0; r < world; ++r)
        EXPECT_LT(rel_error(got[r], want), 1e-9)
            << "world " << world << " rank " << r << (optimizer_zero_grad ? " (optimizer's zero_grad)" : "");
    }
}

// Groups whose state differs (amsgrad for the biases only), saved at world 4
// and resumed at 3, 2 and 1 with the same groups, as the run that never
// stopped; every rank saves the same tensors.
TEST(FsdpGroups, StateOfGroupsReshards) {
  const auto biases = bias_names();
  const auto amsgrad = torch::optim::AdamWOptions(5e-3).weight_decay(0.0).amsgrad(true);
  std::vector<std::vector<cohort::NamedTensor>> model(4), optim(4);
  std::map<std::string, torch::Tensor> want;
  run_ranks(4, "shm", [&](cohort::ProcessGroup& pg) {
    torch::set_num_threads(1);
    FNet net;
    net->to(torch::kDouble);
    FullyShardedDataParallel fsdp(net.ptr(), borrowed(pg));
    auto groups = fsdp.parameter_groups({biases});
    auto opt = grouped_adamw(groups[0], groups[1], amsgrad);
    fsdp_steps(fsdp, *opt, net, {}, 0, 5);
    model[pg.rank()] = fsdp.state_shard();
    optim[pg.rank()] = fsdp.optimizer_state_shard(*opt);
    fsdp_steps(fsdp, *opt, net, {}, 5, 10);
    const auto full = by_name(fsdp.full_state());
    if (pg.rank() == 0) want = full;
  });
  std::set<std::string> names0;
  for (const auto& t : optim[0]) names0.insert(t.name);
  EXPECT_TRUE(names0.count("fsdp.unit0.max_exp_avg_sq")) << "amsgrad's state is saved";
  for (int r = 1; r < 4; ++r) {
    std::set<std::string> names;
    for (const auto& t : optim[r]) names.insert(t.name);
    EXPECT_EQ(names, names0) << "rank " << r << " saves other tensors than rank 0";
  }
  for (int world : {3, 2, 1}) {
    std::vector<std::map<std::string, torch::Tensor>> got(world);
    run_ranks(world, "shm", [&](cohort::ProcessGroup& pg) {
      torch::set_num_threads(1);
      FNet net;
      net->to(torch::kDouble);
      FullyShardedDataParallel fsdp(net.ptr(), borrowed(pg));
      auto groups = fsdp.parameter_groups({biases});
      auto opt = grouped_adamw(groups[0], groups[1], amsgrad);
      fsdp.load_state_shards([&](int k) { return model.at(k); });
      fsdp.load_optimizer_state_shards(*opt, [&](int k) { return optim.at(k); });
      fsdp_steps(fsdp, *opt, net, {}, 5, 10);
      got[pg.rank()] = by_name(fsdp.full_state());
    });
    for (int r = 0; r < world; ++r) EXPECT_LT(rel_error(got[r], want), 1e-9) << "world " << world << " rank " << r;
  }
}

// Optimizer state is saved per unit chunk whatever the groups cut it into,
// so state saved with groups at world 4 resumes at world 2 in an FSDP whose
// optimizer is over parameters() (one group), and the other way round. Each
// continues as one process that changes optimizer at step 5 and keeps every
// parameter's moments.
TEST(FsdpGroups, GroupedAndUngroupedStateConvertAcrossWorlds) {
  for (bool saved_grouped : {true, false}) {
    const MakeOptimizer before = saved_grouped ? MakeOptimizer(grouped) : MakeOptimizer(ungrouped);
    const MakeOptimizer after = saved_grouped ? MakeOptimizer(ungrouped) : MakeOptimizer(grouped);
    const SavedRun saved = save_mid_run(4, before);
    FNet plain;
    plain->to(torch::kDouble);
    const auto with_groups = plain_grouped(plain);
    torch::optim::AdamW without(plain->parameters(), adamw());
    torch::optim::AdamW& first = saved_grouped ? *with_groups : without;
    torch::optim::AdamW& second = saved_grouped ? without : *with_groups;
    plain_steps(plain, first, 0, 5);
    copy_state(first, second);
    const auto want_losses = plain_steps(plain, second, 5, 10);
    const auto want = by_name(cohort::torch::module_state(*plain));
    const std::string what = saved_grouped ? "grouped saved, ungrouped loaded" : "ungrouped saved, grouped loaded";
    EXPECT_GT(rel_error(saved.want, want), 1e-3) << what << ": the switch of groups should change the training";
    const Resumed got = resume_in_fsdp(2, after, [&](FullyShardedDataParallel& fsdp, torch::optim::AdamW& opt) {
      fsdp.load_state_shards([&](int k) { return saved.model.at(k); });
      fsdp.load_optimizer_state_shards(opt, [&](int k) { return saved.optim.at(k); });
    });
    expect_resumed(got, want_losses, want, 1e-9, 1e-9, what);
  }
}

// A grouped FSDP's files (world 4) in one process without FSDP:
// fsdp_optimizer_state_to_full names the state by position in one group
// over the model's parameters(), which load_optimizer_state refuses for an
// optimizer with the groups (naming the grouping, changing nothing) and
// tp::load_full_optimizer_state takes, by the parameters' places in the
// model: it continues as the run that never stopped.
TEST(FsdpGroups, GroupedShardsResumeInOneProcessWithTheSameGroups) {
  const SavedRun saved = save_mid_run(4, grouped);
  FNet plain;
  plain->to(torch::kDouble);
  cohort::torch::load_module_state(*plain,
                                   cohort::torch::fsdp_state_to_full(*plain, [&](int k) { return saved.model.at(k); }));
  const auto full = cohort::torch::fsdp_optimizer_state_to_full(*plain, [&](int k) { return saved.optim.at(k); });
  const auto opt = plain_grouped(plain);
  expect_invalid([&] { cohort::torch::load_optimizer_state(*opt, full); }, "parameter grouping");
  EXPECT_TRUE(opt->state().empty()) << "a refused load installed state";
  EXPECT_EQ(opt->param_groups()[1].options().get_lr(), no_decay().lr()) << "a refused load changed a learning rate";
  cohort::torch::tp::load_full_optimizer_state(*plain, *opt, full);
  const auto losses = plain_steps(plain, *opt, 5, 10);
  ASSERT_EQ(saved.losses.size(), 5u);
  for (size_t s = 0; s < 5; ++s)
    EXPECT_NEAR(losses[s], saved.losses[s], 1e-9 * std::abs(saved.losses[s])) << "step " << s + 5;
  EXPECT_LT(rel_error(by_name(cohort::torch::module_state(*plain)), saved.want), 1e-9);
}

// A one-process AdamW with the two groups, after 5 steps, resumed in FSDP
// with the same groups at worlds 2 and 3: its state named by parameter
// (tp::full_optimizer_state) loads, and FSDP continues as the one process
// does. optimizer_state() of the grouped optimizer names positions in each
// group, not parameters: refused, naming the way that works, changing nothing.
TEST(FsdpGroups, APlainGroupedStateResumesInFsdpWithTheSameGroups) {
  FNet plain;
  plain->to(torch::kDouble);
  const auto opt = plain_grouped(plain);
  plain_steps(plain, *opt, 0, 5);
  const auto model = cohort::torch::module_state(*plain);
  const auto grouped_state = cohort::torch::optimizer_state(*opt);
  const auto named_state = cohort::torch::tp::full_optimizer_state(*plain, *opt);
  const auto want_losses = plain_steps(plain, *opt, 5, 10);
  const auto want = by_name(cohort::torch::module_state(*plain));
  for (int world : {2, 3}) {
    const Resumed got = resume_in_fsdp(world, grouped, [&](FullyShardedDataParallel& fsdp, torch::optim::AdamW& o) {
      fsdp.load_full_state(model);
      expect_invalid([&] { fsdp.load_full_optimizer_state(o, grouped_state); }, "belongs to a second param group");
      expect_invalid([&] { fsdp.load_full_optimizer_state(o, grouped_state); },
                     "HINT: save it named by parameter with cohort::torch::tp::full_optimizer_state");
      EXPECT_TRUE(o.state().empty()) << "a refused load installed state";
      fsdp.load_full_optimizer_state(o, named_state);
    });
    expect_resumed(got, want_losses, want, 1e-9, 1e-9, "world " + std::to_string(world));
  }
}

// Accumulation with groups: two micro-batches a step, the first under
// no_sync() (whole gradients kept in .grad, reduced with the second's), at
// worlds 2 and 3, with FSDP's zero_grad and the optimizer's (the runs' .grad
// set to none): one process with the same groups on the same micro-batches.
TEST(FsdpGroups, NoSyncAccumulationEqualsOneProcessWithTheSameGroups) {
  FNet plain;
  plain->to(torch::kDouble);
  plain_steps(plain, *plain_grouped(plain), 0, 5, 2);
  const auto want = by_name(cohort::torch::module_state(*plain));
  for (int world : {2, 3})
    for (bool optimizer_zero_grad : {false, true}) {
      std::vector<std::map<std::string, torch::Tensor>> got(world);
      run_ranks(world, "shm", [&](cohort::ProcessGroup& pg) {
        torch::set_num_threads(1);
        FNet net;
        net->to(torch::kDouble);
        FullyShardedDataParallel fsdp(net.ptr(), borrowed(pg));
        const auto opt = grouped(fsdp);
        fsdp_steps(fsdp, *opt, net, {.micro = 2, .no_sync = true, .optimizer_zero_grad = optimizer_zero_grad}, 0, 5);
        got[pg.rank()] = by_name(fsdp.full_state());
      });
      for (int r = 0; r < world; ++r)
        EXPECT_LT(rel_error(got[r], want), 1e-9)
            << "world " << world << " rank " << r << (optimizer_zero_grad ? " (optimizer's zero_grad)" : "");
    }
}

TEST(FsdpGroups, BadGroupsAreNamed) {
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    FNet net;
    FullyShardedDataParallel fsdp(net.ptr(), borrowed(pg));
    expect_invalid([&] { fsdp.parameter_groups({{"head.weight", "nope.bias"}}); },
                   "group 1 names 'nope.bias', which is not a trainable parameter");
    expect_invalid([&] { fsdp.parameter_groups({{"head.bias"}, {"head.weight", "head.bias"}}); },
                   "group 2 names 'head.bias', which group 1 names already");
    expect_invalid([&] { fsdp.parameter_groups({{}}); }, "group 1 names no parameter");
    auto groups = fsdp.parameter_groups({{"head.bias"}});
    expect_invalid([&] { fsdp.parameter_groups({{"head.bias"}}); }, "called a second time");
    // An optimizer over some of the runs only, or SGD groups that mix momentum and none.
    torch::optim::AdamW part(std::vector<torch::Tensor>(groups[0].begin() + 1, groups[0].end()), adamw());
    expect_invalid([&] { (void)fsdp.optimizer_state_shard(part); }, "nor over its parameter_groups()");
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(groups[0], std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.1).momentum(0.9)));
    g.emplace_back(groups[1], std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.1)));
    torch::optim::SGD mixed(std::move(g), torch::optim::SGDOptions(0.1));
    expect_invalid([&] { (void)fsdp.optimizer_state_shard(mixed); }, "have momentum and the others none");
  });
}

// A module over a weight it is given (to tie one tensor into two modules).
struct HasWImpl : torch::nn::Module {
  explicit HasWImpl(torch::Tensor w) { weight = register_parameter("weight", w); }
  torch::Tensor forward(torch::Tensor x) { return x.matmul(weight); }
  torch::Tensor weight;
};
TORCH_MODULE(HasW);

// Tied weights across two units: named, with both units.
TEST(FsdpErrors, AParameterSharedBetweenUnitsIsNamed) {
  struct Tied : torch::nn::Module {
    Tied() {
      const auto w = torch::randn({4, 4}).requires_grad_(true);
      a = register_module("a", std::make_shared<FsdpUnit<HasW>>(HasW(w)));
      b = register_module("b", std::make_shared<FsdpUnit<HasW>>(HasW(w)));
    }
    std::shared_ptr<FsdpUnit<HasW>> a, b;
  };
  run_ranks(1, "shm", [&](cohort::ProcessGroup& pg) {
    auto m = std::make_shared<Tied>();
    expect_invalid([&] { FullyShardedDataParallel fsdp(m, borrowed(pg)); },
                   "parameter 'b.weight' of unit 'b' is the same tensor as 'a.weight' of unit 'a'");
  });
}

// A second backward over one graph, an FSDP over a model whose shards an
// earlier FSDP took, an optimizer whose state FSDP cannot cut: each named.
TEST(FsdpErrors, UnsupportedUseIsRefusedByName) {
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    torch::set_num_threads(1);
    FNet net;
    {
      FullyShardedDataParallel fsdp(net.ptr(), borrowed(pg));
      fsdp.pre_forward();
      auto loss = torch::mse_loss(net->forward(inputs(pg.rank() * 4, 4)), targets(pg.rank() * 4, 4));
      loss.backward({}, /*retain_graph=*/true);
      expect_invalid([&] { loss.backward(); }, "a second backward over one graph");
      torch::optim::RMSprop rms(fsdp.parameters(), torch::optim::RMSpropOptions(0.01));
      expect_invalid([&] { (void)fsdp.optimizer_state_shard(rms); }, "none of SGD, Adam and AdamW");
      // train()/eval() reach the wrapped module
      net->eval();
      EXPECT_FALSE(net->in->inner()->is_training());
      net->train();
      EXPECT_TRUE(net->in->inner()->is_training());
    }
    expect_invalid([&] { FullyShardedDataParallel again(net.ptr(), borrowed(pg)); }, "has no data");
  });
}

TEST(FsdpErrors, BadInputIsNamed) {
  run_ranks(1, "shm", [&](cohort::ProcessGroup& pg) {
    FNet net;
    expect_invalid([&] { FullyShardedDataParallel f(nullptr, borrowed(pg)); }, "module is null");
    expect_invalid([&] { FullyShardedDataParallel f(net.ptr(), nullptr); }, "process group is null");
    expect_invalid([&] { FullyShardedDataParallel f(net.ptr(), borrowed(pg), {.prefetch = -1}); }, "prefetch must be");
    auto whole = std::make_shared<FsdpUnit<Linear>>(Linear(2, 2));
    expect_invalid([&] { FullyShardedDataParallel f(whole, borrowed(pg)); }, "the model itself is an FsdpUnit");
    expect_invalid([&] { FullyShardedDataParallel f(net.ptr(), borrowed(pg), {.cpu_offload = true}); },
                   "cpu_offload is for a module on a GPU");
    FullyShardedDataParallel fsdp(net.ptr(), borrowed(pg));
    expect_invalid([&] { FullyShardedDataParallel again(net.ptr(), borrowed(pg)); }, "already belongs");
    expect_invalid([&] { net->forward(inputs(0, 2)); }, "before pre_forward()");
    expect_invalid([&] { fsdp.clip_grad_norm(0); }, "max_norm must be");
  });
}

// A model that differs across ranks is named before anything moves.
TEST(FsdpErrors, DifferentModelsOrWrappingsAreNamed) {
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    std::shared_ptr<torch::nn::Module> m;
    if (pg.rank() == 0) m = FNet().ptr();
    else {
      struct Unwrapped : torch::nn::Module {  // the same parameters, "in" not a unit
        Unwrapped() {
          register_module("in", Linear(8, 7));
          int k = 0;
          register_module("block", Block(k));
          register_module("mid", std::make_shared<FsdpUnit<Linear>>(Linear(8, 8)));
          register_module("head", Linear(8, 4));
        }
      };
      m = std::make_shared<Unwrapped>();
    }
    expect_invalid([&] { FullyShardedDataParallel f(m, borrowed(pg)); }, "FSDP unit");
  });
}

}  // namespace
