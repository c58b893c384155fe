// Pipeline parallelism: every schedule runs to completion on every stage
// count (simulated with one FIFO per link, as the runner's link groups
// behave), keeps the activations it promises, and the runner gives the loss
// and gradients of one process on the whole batch, alone and with DDP over a
// dp dimension; bad input fails on every stage, by name. Ranks run as
// threads over a MemoryStore.
#include <gtest/gtest.h>

#include <deque>
#include <map>
#include <mutex>

#include "cohort/mesh.hpp"
#include "cohort/torch.hpp"
#include "cohort/torch_pipeline.hpp"
#include "cohort/torch_train.hpp"
#include "test_util.hpp"

namespace {

namespace pp = cohort::torch::pp;
using cohort::ProcessGroup;
using cohort::testing::run_ranks;
using pp::Action;
using pp::Schedule;
using torch::Tensor;

std::shared_ptr<ProcessGroup> borrow(ProcessGroup& pg) { return {&pg, [](ProcessGroup*) {}}; }

// Runs every stage's action list with unbounded FIFO links (sends never
// block, a receive waits for its message): "" when all finish and every
// message arrives in the order its receiver expects, else what went wrong.
std::string simulate(Schedule s, int p, int m, int v) {
  std::vector<std::vector<Action>> acts;
  for (int r = 0; r < p; ++r) acts.push_back(pp::schedule_actions(s, r, p, m, v));
  const int vs_count = p * v;
  auto vstage = [&](int r, int c) { return c * p + r; };
  // act[r]: activations r sends to r+1; grad[r]: gradients r+1 sends to r. Entries: (micro, edge).
  std::vector<std::deque<std::pair<int, int>>> act(p), grad(p);
  std::vector<size_t> pc(p, 0);
  std::vector<std::map<std::pair<int, int>, int>> done(p);  // (micro, chunk) -> forwards - backwards
  for (bool moved = true; moved;) {
    moved = false;
    for (int r = 0; r < p; ++r) {
      if (pc[r] == acts[r].size()) continue;
      const Action a = acts[r][pc[r]];
      const int vs = vstage(r, a.chunk);
      if (a.kind == Action::Forward) {
        if (vs > 0) {
          auto& q = act[(r + p - 1) % p];
          if (q.empty()) continue;
          if (q.front() != std::make_pair(a.micro, vs - 1))
            return "stage " + std::to_string(r) + " expected activation of micro " + std::to_string(a.micro) + " first";
          q.pop_front();
        }
        if (vs < vs_count - 1) act[r].push_back({a.micro, vs});
        ++done[r][{a.micro, a.chunk}];
      } else {
        if (done[r][{a.micro, a.chunk}] != 1) return "stage " + std::to_string(r) + " backward before forward";
        if (vs < vs_count - 1) {
          auto& q = grad[r];
          if (q.empty()) continue;
          if (q.front() != std::make_pair(a.micro, vs))
            return "stage " + std::to_string(r) + " expected gradient of micro " + std::to_string(a.micro) + " first";
          q.pop_front();
        }
        if (vs > 0) grad[(r + p - 1) % p].push_back({a.micro, vs - 1});
        --done[r][{a.micro, a.chunk}];
      }
      ++pc[r];
      moved = true;
    }
  }
  for (int r = 0; r < p; ++r)
    if (pc[r] != acts[r].size()) return "deadlock: stage " + std::to_string(r) + " stuck";
  for (int r = 0; r < p; ++r)
    if (acts[r].size() != static_cast<size_t>(2 * m * v)) return "wrong action count";
  return "";
}

TEST(PipelineSchedule, EveryScheduleCompletesInLinkOrder) {
  for (int p = 1; p <= 5; ++p)
    for (int m = 1; m <= 10; ++m) {
      EXPECT_EQ(simulate(Schedule::GPipe, p, m, 1), "") << "gpipe p=" << p << " m=" << m;
      EXPECT_EQ(simulate(Schedule::OneFOneB, p, m, 1), "") << "1f1b p=" << p << " m=" << m;
      if (p >= 2 && m % p == 0) {
        for (int v = 2; v <= 4; ++v)
          EXPECT_EQ(simulate(Schedule::Interleaved, p, m, v), "") << "interleaved p=" << p << " m=" << m << " v=" << v;
      }
    }
}

TEST(PipelineSchedule, OneFOneBKeepsAtMostPActivationsGPipeKeepsM) {
  for (int p = 2; p <= 4; ++p)
    for (int m = 1; m <= 8; ++m) {
      EXPECT_EQ(pp::peak_in_flight(pp::schedule_actions(Schedule::GPipe, 0, p, m)), m);
      EXPECT_EQ(pp::peak_in_flight(pp::schedule_actions(Schedule::OneFOneB, 0, p, m)), std::min(p, m));
      EXPECT_EQ(pp::peak_in_flight(pp::schedule_actions(Schedule::OneFOneB, p - 1, p, m)), 1);
    }
}

// `f` throws InvalidArgument whose message contains `needle`.
void says(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; wanted " << needle;
  } catch (const cohort::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(PipelineSchedule, CountsTheScheduleCannotRunAreNamed) {
  says([] { pp::schedule_actions(Schedule::Interleaved, 0, 2, 3, 2); }, "3 micro-batches do not divide by 2 stages");
  says([] { pp::schedule_actions(Schedule::Interleaved, 0, 2, 4, 1); }, "at least 2 chunks");
  says([] { pp::schedule_actions(Schedule::OneFOneB, 0, 2, 4, 2); }, "need the interleaved schedule");
  says([] { pp::schedule_actions(Schedule::GPipe, 0, 2, 0); }, "0 micro-batches");
  says([] { pp::parse_schedule("zb"); }, "use gpipe, 1f1b or interleaved");
}

// ---- the runner against one process ----------------------------------------

constexpr int64_t kWidth = 6, kBatch = 8;

torch::nn::Linear layer(int i) {
  torch::nn::Linear l(kWidth, kWidth);
  auto gen = at::detail::createCPUGenerator(100 + i);
  torch::NoGradGuard g;
  l->weight.uniform_(-0.6, 0.6, gen);
  l->bias.uniform_(-0.2, 0.2, gen);
  return l;
}
Tensor batch_x() { return torch::cos(torch::arange(kBatch * kWidth, torch::kFloat).view({kBatch, kWidth}) * 0.37); }
Tensor batch_y() { return torch::sin(torch::arange(kBatch * kWidth, torch::kFloat).view({kBatch, kWidth}) * 0.11); }

// The reference: all `layers` in one process, the whole batch.
std::vector<Tensor> reference_grads(int layers, double* loss) {
  torch::nn::Sequential net;
  for (int i = 0; i < layers; ++i) {
    net->push_back(layer(i));
    net->push_back(torch::nn::Functional(torch::tanh));
  }
  Tensor l = torch::mse_loss(net->forward(batch_x()), batch_y());
  l.backward();
  *loss = l.item<double>();
  std::vector<Tensor> g;
  for (const auto& p : net->parameters()) g.push_back(p.grad().clone());
  return g;  // weight, bias per layer
}

struct Case {
  Schedule schedule;
  int stages, micro, chunks, dp = 1;
};

// `layers` = stages * chunks, one per virtual stage; each rank compares its
// layers' gradients with the reference's.
void run_case(const Case& c) {
  const int layers = c.stages * c.chunks;
  double want_loss = 0;
  const auto want = reference_grads(layers, &want_loss);
  run_ranks(c.stages * c.dp, "", [&](ProcessGroup& world) {
    cohort::Mesh mesh(borrow(world), {.dp = c.dp, .tp = 1, .pp = c.stages});
    const int stage = mesh.coord(cohort::MeshDim::pp), dp_rank = mesh.coord(cohort::MeshDim::dp);
    std::vector<torch::nn::Sequential> chunk(c.chunks);
    std::vector<std::unique_ptr<cohort::torch::DistributedDataParallel>> ddp;
    std::vector<pp::Pipeline::ChunkForward> fns;
    for (int k = 0; k < c.chunks; ++k) {
      chunk[k]->push_back(layer(k * c.stages + stage));
      chunk[k]->push_back(torch::nn::Functional(torch::tanh));
      if (c.dp > 1) ddp.push_back(std::make_unique<cohort::torch::DistributedDataParallel>(chunk[k].ptr(), mesh.group_ptr(cohort::MeshDim::dp)));
      fns.push_back([seq = chunk[k]](const Tensor& x, int) mutable { return seq->forward(x); });
    }
    const int64_t local = kBatch / c.dp, mb = local / c.micro;
    pp::PipelineOptions o{.schedule = c.schedule, .micro_batches = c.micro, .chunks = c.chunks, .activation = {mb, kWidth}};
    for (auto& d : ddp) o.ddp.push_back(d.get());
    pp::Pipeline pipe(mesh.group_ptr(cohort::MeshDim::pp), fns, o);
    const Tensor x = batch_x().narrow(0, dp_rank * local, local), y = batch_y().narrow(0, dp_rank * local, local);
    double loss = pipe.step([&](int m) { return x.narrow(0, m * mb, mb); },
                            [&](const Tensor& out, int m) { return torch::mse_loss(out, y.narrow(0, m * mb, mb)); });
    if (c.dp > 1) loss = cohort::torch::allreduce_scalar(mesh.dp(), loss) / c.dp;
    EXPECT_NEAR(loss, want_loss, 1e-6 * std::abs(want_loss));
    for (int k = 0; k < c.chunks; ++k) {
      const int L = k * c.stages + stage;
      const auto params = chunk[k]->parameters();
      for (int i = 0; i < 2; ++i) {
        const double err = (params[i].grad() - want[2 * L + i]).abs().max().item<double>() /
                           want[2 * L + i].abs().max().item<double>();
        EXPECT_LT(err, 1e-5) << "layer " << L << (i ? " bias" : " weight");
      }
    }
    EXPECT_EQ(pipe.stats().peak_in_flight, pp::peak_in_flight(pipe.actions()));
  });
}

TEST(Pipeline, OneFOneBTwoStagesFourMicroBatchesIsOneProcess) { run_case({Schedule::OneFOneB, 2, 4, 1}); }
TEST(Pipeline, GPipeFourStagesIsOneProcess) { run_case({Schedule::GPipe, 4, 4, 1}); }
TEST(Pipeline, OneFOneBFourStagesEightMicroBatchesIsOneProcess) { run_case({Schedule::OneFOneB, 4, 8, 1}); }
TEST(Pipeline, InterleavedTwoStagesTwoChunksIsOneProcess) { run_case({Schedule::Interleaved, 2, 4, 2}); }
TEST(Pipeline, InterleavedThreeChunksIsOneProcess) { run_case({Schedule::Interleaved, 2, 2, 3}); }
TEST(Pipeline, WithDdpOverTwoReplicasIsOneProcess) { run_case({Schedule::OneFOneB, 2, 2, 1, 2}); }
TEST(Pipeline, InterleavedWithDdpIsOneProcess) { run_case({Schedule::Interleaved, 2, 2, 2, 2}); }

// Loss scaling across stages: the scaled gradients, unscaled, are the
// reference's; an inf on one stage makes every stage skip the step.
TEST(Pipeline, LossScalingUnscalesOnEveryStageAndSkipsTogether) {
  double want_loss = 0;
  const auto want = reference_grads(2, &want_loss);
  run_ranks(2, "", [&](ProcessGroup& world) {
    torch::nn::Sequential seq;
    seq->push_back(layer(world.rank()));
    seq->push_back(torch::nn::Functional(torch::tanh));
    cohort::torch::GradScaler scaler({.init_scale = 1024});
    torch::optim::SGD opt(seq->parameters(), torch::optim::SGDOptions(0.1));
    pp::Pipeline pipe(borrow(world), {[&](const Tensor& x, int) { return seq->forward(x); }},
                      {.micro_batches = 2, .activation = {kBatch / 2, kWidth}, .scaler = &scaler});
    auto step = [&] {
      return pipe.step([&](int m) { return batch_x().narrow(0, m * 4, 4); },
                       [&](const Tensor& out, int m) { return torch::mse_loss(out, batch_y().narrow(0, m * 4, 4)); });
    };
    EXPECT_NEAR(step(), want_loss, 1e-6 * want_loss);  // unscaled
    EXPECT_NEAR(seq->parameters()[0].grad().abs().max().item<double>() /
                    want[2 * world.rank()].abs().max().item<double>(), 1024, 1e-2);
    EXPECT_TRUE(scaler.unscale(opt, &world));
    const double err = (seq->parameters()[0].grad() - want[2 * world.rank()]).abs().max().item<double>() /
                       want[2 * world.rank()].abs().max().item<double>();
    EXPECT_LT(err, 1e-5);
    EXPECT_TRUE(scaler.step(opt, &world));
    opt.zero_grad();
    step();
    if (world.rank() == 0) seq->parameters()[0].grad()[0][0] = std::numeric_limits<float>::infinity();
    EXPECT_FALSE(scaler.step(opt, &world)) << "rank " << world.rank() << " stepped past an inf on stage 0";
    EXPECT_EQ(scaler.current_scale(), 512);
  });
}

TEST(PipelineSplit, StageRangesAreEvenOrBalancedAndNeverEmpty) {
  using R = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(pp::stage_ranges(10, 4), (R{{0, 3}, {3, 6}, {6, 8}, {8, 10}}));
  EXPECT_EQ(pp::stage_ranges(4, 2, {1, 3}), (R{{0, 1}, {1, 4}}));
  says([] { pp::stage_ranges(3, 4); }, "3 layers over 4 stages leave stage 3 without a layer");
  says([] { pp::stage_ranges(4, 2, {4, 0}); }, "leave stage 1 without a layer");
  says([] { pp::stage_ranges(4, 2, {1, 2}); }, "adds up to 3 layers, but the model has 4");
  says([] { pp::stage_ranges(4, 2, {4}); }, "1 stages' layer counts for 2 stages");
}

// A Sequential split into interleaved chunks keeps the model's own layers and
// names, and pipelined it trains as the whole.
TEST(PipelineSplit, SplitSequentialTrainsAsTheWholeModel) {
  double want_loss = 0;
  const auto want = reference_grads(4, &want_loss);
  run_ranks(2, "", [&](ProcessGroup& pg) {
    torch::nn::Sequential whole;
    for (int i = 0; i < 4; ++i) {
      whole->push_back(layer(i));
      whole->push_back(torch::nn::Functional(torch::tanh));
    }
    auto chunks = pp::split_sequential(whole, pg.rank(), 2, 2);  // virtual stages: 2 children each
    ASSERT_EQ(chunks.size(), 2u);
    const int first = 2 * pg.rank();  // chunk 0 is virtual stage rank, chunk 1 is rank + 2
    EXPECT_EQ(chunks[0]->named_parameters().keys(),
              (std::vector<std::string>{std::to_string(first) + ".weight", std::to_string(first) + ".bias"}));
    EXPECT_TRUE(chunks[1]->parameters()[0].is_same(whole->parameters()[2 * (pg.rank() + 2)]));
    std::vector<pp::Pipeline::ChunkForward> fns;
    for (auto& c : chunks) fns.push_back([c](const Tensor& x, int) mutable { return c->forward(x); });
    pp::Pipeline pipe(borrow(pg), fns,
                      {.schedule = Schedule::Interleaved, .micro_batches = 2, .chunks = 2, .activation = {4, kWidth}});
    const double loss = pipe.step([](int m) { return batch_x().narrow(0, m * 4, 4); },
                                  [](const Tensor& o, int m) { return torch::mse_loss(o, batch_y().narrow(0, m * 4, 4)); });
    EXPECT_NEAR(loss, want_loss, 1e-6 * want_loss);
    for (int c = 0; c < 2; ++c) {
      const int L = c * 2 + pg.rank();
      const double err = (chunks[c]->parameters()[0].grad() - want[2 * L]).abs().max().item<double>() /
                         want[2 * L].abs().max().item<double>();
      EXPECT_LT(err, 1e-5) << "layer " << L;
    }
  });
}

TEST(Pipeline, MismatchedMicroBatchCountsFailOnEveryStage) {
  std::mutex mu;
  int refused = 0;
  run_ranks(2, "", [&](ProcessGroup& pg) {
    try {
      pp::Pipeline pipe(borrow(pg), {[](const Tensor& x, int) { return x; }},
                        {.micro_batches = pg.rank() == 1 ? 3 : 4, .activation = {2, kWidth}});
      ADD_FAILURE() << "built";
    } catch (const cohort::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("stage 0 runs 1f1b schedule, 4 micro-batches"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("but stage 1 runs 1f1b schedule, 3 micro-batches"), std::string::npos)
          << e.what();
      std::lock_guard lock(mu);
      ++refused;
    }
  });
  EXPECT_EQ(refused, 2);
}

// Options that only one stage cannot run (interleaved with 3 micro-batches on
// 2 stages) fail on both, by the comparison, instead of leaving one waiting.
TEST(Pipeline, OptionsOneStageCannotRunFailOnEveryStage) {
  std::mutex mu;
  int refused = 0;
  run_ranks(2, "", [&](ProcessGroup& pg) {
    const auto f = [](const Tensor& x, int) { return x; };
    try {
      pp::Pipeline pipe(borrow(pg), {f, f},
                        {.schedule = Schedule::Interleaved, .micro_batches = pg.rank() == 1 ? 3 : 4, .chunks = 2,
                         .activation = {2, kWidth}});
      ADD_FAILURE() << "built";
    } catch (const cohort::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("but stage 1 runs interleaved schedule, 3 micro-batches"), std::string::npos)
          << e.what();
      std::lock_guard lock(mu);
      ++refused;
    }
  }, cohort::Millis(5000));
  EXPECT_EQ(refused, 2);
}

// A step that failed (here stage 0's chunk throws; stage 1 times out waiting
// for its activation) leaves the pipeline refusing further steps on both.
TEST(Pipeline, AFailedStepLeavesThePipelineUnusable) {
  run_ranks(2, "", [&](ProcessGroup& pg) {
    auto l = layer(0);
    pp::Pipeline pipe(borrow(pg), {[&](const Tensor& x, int) -> Tensor {
                        if (pg.rank() == 0) throw std::runtime_error("chunk failed");
                        return l->forward(x);
                      }},
                      {.micro_batches = 1, .activation = {kBatch, kWidth}});
    auto step = [&] { pipe.step([](int) { return batch_x(); }, [](const Tensor& o, int) { return o.sum(); }); };
    EXPECT_ANY_THROW(step());
    try {
      step();
      ADD_FAILURE() << "a second step ran";
    } catch (const cohort::Error& e) {
      EXPECT_NE(std::string(e.what()).find("an earlier step failed"), std::string::npos) << e.what();
    }
  }, cohort::Millis(1500));
}

TEST(Pipeline, AnActivationOfAnotherShapeIsNamed) {
  run_ranks(2, "", [&](ProcessGroup& pg) {
    auto l = layer(0);
    pp::Pipeline pipe(borrow(pg), {[&](const Tensor& x, int) { return l->forward(x).narrow(1, 0, 3); }},
                      {.micro_batches = 1, .activation = {kBatch, kWidth}});
    if (pg.rank() == 0) {
      try {
        pipe.step([](int) { return batch_x(); }, [](const Tensor& o, int) { return o.sum(); });
        ADD_FAILURE() << "sent a wrong shape";
      } catch (const cohort::InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find("returned [8, 3]"), std::string::npos) << e.what();
      }
    }
  }, cohort::Millis(3000));
}

}  // namespace
