// recompute(): the gradients, the dropout masks and the generators' states
// afterwards are those of the same model run without it; DDP averages every
// gradient when backward starts inside a recomputed part; misuse is named.
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>

#include "cohort/torch.hpp"
#include "cohort/torch_fsdp.hpp"
#include "cohort/torch_recompute.hpp"
#include "cohort/torch_tensor_parallel.hpp"
#include "cohort/torch_train.hpp"
#include "cohort/torch_zero.hpp"
#include "test_util.hpp"
#include "torch/ddp_test_model.hpp"

namespace {

using cohort::testing::run_ranks;
using cohort::torch::recompute;

// Two layers with dropout between them: one mask from the default
// generator (torch::dropout), one from a generator of the model's own.
struct DropNetImpl : torch::nn::Module {
  explicit DropNetImpl(uint64_t seed) : gen(at::make_generator<at::CPUGeneratorImpl>(seed)) {
    fc1 = register_module("fc1", torch::nn::Linear(8, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 4));
    torch::NoGradGuard g;
    int k = 0;
    for (auto& p : parameters()) {
      auto flat = p.view({-1});
      for (int64_t i = 0; i < flat.numel(); ++i) flat[i] = std::sin(0.37 * (k++)) * 0.5;
    }
  }
  torch::Tensor hidden(const torch::Tensor& x) {
    auto h = torch::dropout(torch::tanh(fc1->forward(x)), 0.3, is_training());
    return cohort::torch::tp::dropout(h, 0.2, gen, is_training());
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  at::Generator gen;
};
TORCH_MODULE(DropNet);

struct Outcome {
  double loss = 0;
  std::map<std::string, torch::Tensor> grads;
  torch::Tensor input_grad;
  double next_default = 0, next_own = 0;  // the generators' next draws after the step
};

Outcome run(bool with_recompute) {
  torch::manual_seed(7);
  DropNet net(11);
  net->to(torch::kDouble);
  auto x = ddp_test::inputs(0, 16).to(torch::kDouble).requires_grad_(true);
  torch::Tensor h = with_recompute
                        ? recompute([net](const torch::Tensor& t) mutable { return net->hidden(t); }, x, {net->gen})
                        : net->hidden(x);
  auto loss = torch::mse_loss(net->fc2->forward(h), ddp_test::targets(0, 16).to(torch::kDouble));
  loss.backward();
  Outcome r;
  r.loss = loss.item<double>();
  for (const auto& p : net->named_parameters()) r.grads[p.key()] = p.value().grad().clone();
  r.input_grad = x.grad().clone();
  r.next_default = torch::rand({1}, torch::kDouble).item<double>();
  r.next_own = torch::rand({1}, net->gen, torch::kDouble).item<double>();
  return r;
}

TEST(Recompute, GradientsAndDropoutMasksAreThoseOfThePlainRun) {
  const Outcome plain = run(false), again = run(true);
  EXPECT_EQ(again.loss, plain.loss);
  ASSERT_EQ(again.grads.size(), 4u);
  for (const auto& [name, g] : plain.grads) EXPECT_TRUE(torch::equal(again.grads.at(name), g)) << name;
  EXPECT_TRUE(torch::equal(again.input_grad, plain.input_grad));
  EXPECT_EQ(again.next_default, plain.next_default);
  EXPECT_EQ(again.next_own, plain.next_own);
}

// The gradients (after `steps` SGD steps, the weights) of Net trained under
// CPU bfloat16 autocast, its forward recomputed or not; `side` adds a term
// that uses fc1 again, with gradients, in the same Autocast scope.
std::vector<torch::Tensor> autocast_run(bool with, int steps, double side) {
  ddp_test::Net net;
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.5));
  std::vector<torch::Tensor> out;
  for (int step = 0; step < steps; ++step) {
    sgd.zero_grad();
    auto x = ddp_test::inputs(step * 8, 8);
    torch::Tensor loss;
    {
      cohort::torch::Autocast autocast(torch::kBFloat16);
      auto y = with ? recompute([net](const torch::Tensor& t) mutable { return net->forward(t); }, x) : net->forward(x);
      EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
      loss = torch::mse_loss(y.to(torch::kFloat), ddp_test::targets(step * 8, 8));
      if (side != 0) loss = loss + side * net->fc1->forward(x).pow(2).sum().to(torch::kFloat);
    }
    loss.backward();
    sgd.step();
  }
  for (const auto& p : net->parameters()) out.push_back(steps == 1 ? p.grad().clone() : p.detach().clone());
  return out;
}

// The second run computes under the autocast of the first, although
// backward runs outside the Autocast scope: three steps give the weights of
// the run without recomputation, bit for bit (the weights' cached casts do
// not outlive a step). A weight used again outside the recomputed part in
// the same scope keeps that use's gradient (the first run caches no cast
// without a gradient history); the casts are shared differently there, so
// the sums round differently: 1e-2.
TEST(Recompute, TheSecondRunHasTheFirstRunsAutocast) {
  const auto plain = autocast_run(false, 3, 0), again = autocast_run(true, 3, 0);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(again[i], plain[i])) << "param " << i;
  const auto plain_side = autocast_run(false, 1, 0.1), again_side = autocast_run(true, 1, 0.1);
  for (size_t i = 0; i < plain_side.size(); ++i)
    EXPECT_TRUE(torch::allclose(again_side[i], plain_side[i], 1e-2, 1e-3)) << "param " << i;
  EXPECT_FALSE(cohort::torch::autocast_enabled(c10::DeviceType::CPU));
}

// Without grad mode it is the function itself; an input without gradient
// still gives the parameters inside theirs.
TEST(Recompute, EvaluationAndAnInputWithoutGradient) {
  ddp_test::Net net;
  auto x = ddp_test::inputs(0, 4);
  {
    torch::NoGradGuard g;
    auto y = recompute([net](const torch::Tensor& t) mutable { return net->forward(t); }, x);
    EXPECT_FALSE(y.requires_grad());
    EXPECT_TRUE(torch::equal(y, net->forward(x)));
  }
  recompute([net](const torch::Tensor& t) mutable { return net->forward(t); }, x).sum().backward();
  ddp_test::Net plain;
  plain->forward(x).sum().backward();
  for (size_t i = 0; i < net->parameters().size(); ++i)
    EXPECT_TRUE(torch::allclose(net->parameters()[i].grad(), plain->parameters()[i].grad(), 1e-6, 1e-7)) << i;
}

// Runs train(pg, with) on 2 thread-ranks without recomputation, then with
// it: every rank's tensors with it must equal rank 0's without (1e-12).
void expect_same_with_and_without(
    const std::function<std::vector<torch::Tensor>(cohort::ProcessGroup&, bool with)>& train, const std::string& what) {
  std::vector<std::vector<torch::Tensor>> got(2), want(2);
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    torch::set_num_threads(1);
    want[pg.rank()] = train(pg, false);
    got[pg.rank()] = train(pg, true);
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(got[r].size(), want[0].size()) << what;
    for (size_t i = 0; i < got[r].size(); ++i)
      EXPECT_TRUE(torch::allclose(got[r][i], want[0][i], 1e-12, 1e-14)) << what << " rank " << r << " tensor " << i;
  }
}

// DDP queues its finalize() when the first gradient arrives. When that is
// inside a recomputed part, the nested backward ends first: finalize must
// still wait for the outer one (the whole model, then its last layer only,
// recomputed), and every gradient comes out averaged.
TEST(Recompute, DdpAveragesEveryGradientWhenBackwardStartsInsideARecomputedPart) {
  for (bool whole : {true, false}) {
    expect_same_with_and_without(
        [whole](cohort::ProcessGroup& pg, bool with) {
          ddp_test::Net net;
          net->to(torch::kDouble);
          cohort::torch::DistributedDataParallel ddp(net.ptr(), ddp_test::borrowed(pg));
          ddp.pre_forward();
          auto x = ddp_test::inputs(pg.rank() * 6, 6).to(torch::kDouble);
          torch::Tensor y;
          if (!with) y = net->forward(x);
          else if (whole) y = recompute([net](const torch::Tensor& t) mutable { return net->forward(t); }, x);
          else y = recompute([net](const torch::Tensor& t) mutable { return net->fc2->forward(t); }, torch::tanh(net->fc1->forward(x)));
          torch::mse_loss(y, ddp_test::targets(pg.rank() * 6, 6).to(torch::kDouble)).backward();
          std::vector<torch::Tensor> grads;
          for (const auto& p : net->parameters()) grads.push_back(p.grad().clone());
          return grads;
        },
        whole ? "whole model" : "last layer");
  }
}

// ZeRO-2 reduce-scatters each bucket from DDP's hooks during backward and
// takes the results in finalize(): with the model's last layer recomputed
// (the first gradients come from the nested backward), three steps give the
// parameters they give without recomputation.
TEST(Recompute, Zero2StepsAsWithout) {
  expect_same_with_and_without(
      [](cohort::ProcessGroup& pg, bool with) {
        ddp_test::Net net;
        net->to(torch::kDouble);
        cohort::torch::ZeroOptimizer opt(net.ptr(), ddp_test::borrowed(pg), torch::optim::AdamWOptions(1e-2),
                                         {.stage = cohort::torch::ZeroStage::Two, .bucket_cap_mb = 0.0005,
                                          .first_bucket_mb = 0.0005});
        for (int step = 0; step < 3; ++step) {
          opt.zero_grad();
          opt.pre_forward();
          const int64_t at = step * 12 + pg.rank() * 6;
          auto h = torch::tanh(net->fc1->forward(ddp_test::inputs(at, 6).to(torch::kDouble)));
          auto y = with ? recompute([net](const torch::Tensor& t) mutable { return net->fc2->forward(t); }, h)
                        : net->fc2->forward(h);
          torch::mse_loss(y, ddp_test::targets(at, 6).to(torch::kDouble)).backward();
          opt.step();
        }
        std::vector<torch::Tensor> params;
        for (const auto& p : net->parameters()) params.push_back(p.detach().clone());
        return params;
      },
      "ZeRO-2");
}

template <class F>
void expect_error(F&& call, const std::string& words) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one naming: " << words;
  } catch (const cohort::Error& e) {
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  } catch (const c10::Error& e) {  // thrown through the autograd engine
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

TEST(Recompute, MisuseIsNamed) {
  ddp_test::Net net;
  auto x = ddp_test::inputs(0, 4).requires_grad_(true);
  const auto f = [net](const torch::Tensor& t) mutable { return net->forward(t); };
  expect_error([&] { (void)recompute(nullptr, x); }, "the function is empty");
  expect_error([&] { (void)recompute(f, torch::Tensor()); }, "input tensor is undefined");
  expect_error([&] { (void)recompute([](const torch::Tensor& t) { return t.to(torch::kLong); }, x); }, "returned a Long tensor");
  expect_error([&] { (void)recompute([](const torch::Tensor&) { return torch::Tensor(); }, x); }, "undefined tensor");

  auto input = ddp_test::inputs(0, 4).requires_grad_(false);
  auto y = recompute(f, input);
  input.add_(1.0);
  expect_error([&] { y.sum().backward(); }, "changed in place after the forward pass");

  auto z = recompute(f, x);
  z.sum().backward({}, /*retain_graph=*/true);
  expect_error([&] { z.sum().backward(); }, "a second backward through the same recompute() call");

  auto w = torch::ones({4, 8}, torch::requires_grad());
  auto second = recompute([w](const torch::Tensor& t) { return (t * w).sum(1).pow(2); }, x);
  expect_error([&] { (void)torch::autograd::grad({second.sum()}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true); },
               "create_graph");

  // The identity is a tensor of its own, so x keeps its history.
  auto same = recompute([](const torch::Tensor& t) { return t; }, x);
  EXPECT_FALSE(same.is_same(x));
}

TEST(Recompute, AnFsdpUnitInsideIsRefusedByName) {
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    auto root = std::make_shared<torch::nn::Module>();
    auto unit = root->register_module("layer", std::make_shared<cohort::torch::FsdpUnit<torch::nn::Linear>>(torch::nn::Linear(8, 4)));
    cohort::torch::FullyShardedDataParallel fsdp(root, ddp_test::borrowed(pg));
    fsdp.pre_forward();
    expect_error([&] { (void)recompute([unit](const torch::Tensor& t) mutable { return unit->forward(t); }, ddp_test::inputs(0, 2)); },
                 "unit 'layer' runs inside recompute()");
  });
}

}  // namespace
