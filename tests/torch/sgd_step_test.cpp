// cohort::torch::sgd_step against torch::optim::SGD::step(): two copies of the
// same parameters get the same gradients for several steps, one stepped by
// LibTorch and one by sgd_step; parameters and momentum buffers must agree.
#include <gtest/gtest.h>

#include "cohort/error.hpp"
#include "cohort/torch_train.hpp"
#include "torch/optimizer_test_util.hpp"
#include "torch/state_key.hpp"

namespace {

namespace ct = cohort::torch;
using optimizer_test::clones;
using optimizer_test::set_grads;


torch::Tensor momentum_of(torch::optim::SGD& opt, const torch::Tensor& p) {
  auto it = opt.state().find(cohort::torch::state_key(p));
  return it == opt.state().end() ? torch::Tensor() : static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer();
}

void expect_same_run(const torch::optim::SGDOptions& o, bool skip_one = false, torch::Dtype dtype = torch::kFloat) {
  auto a = optimizer_test::make_params(7, dtype);
  auto b = clones(a);
  torch::optim::SGD ref(a, o), fused(b, o);
  for (int step = 0; step < 6; ++step) {
    set_grads(a, step, skip_one);
    set_grads(b, step, skip_one);
    ref.step();
    ct::sgd_step(fused);
  }
  for (size_t i = 0; i < a.size(); ++i) {
    SCOPED_TRACE("parameter " + std::to_string(i));
    // One rounding per operation apart at most (usually bit-identical).
    EXPECT_TRUE(torch::allclose(a[i], b[i], 1e-6, 1e-6)) << (a[i] - b[i]).abs().max().item<double>();
    auto ma = momentum_of(ref, a[i]), mb = momentum_of(fused, b[i]);
    ASSERT_EQ(ma.defined(), mb.defined());
    if (ma.defined()) {
      EXPECT_TRUE(torch::allclose(ma, mb, 1e-6, 1e-6));
    }
  }
}

TEST(SgdStep, PlainSgd) { expect_same_run(torch::optim::SGDOptions(0.1)); }
TEST(SgdStep, Momentum) { expect_same_run(torch::optim::SGDOptions(0.05).momentum(0.9)); }
TEST(SgdStep, MomentumDampeningWeightDecay) {
  expect_same_run(torch::optim::SGDOptions(0.05).momentum(0.9).dampening(0.1).weight_decay(5e-4));
}
TEST(SgdStep, Nesterov) { expect_same_run(torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-3)); }
TEST(SgdStep, ParameterWithoutGradientStaysPut) { expect_same_run(torch::optim::SGDOptions(0.05).momentum(0.9), true); }
TEST(SgdStep, DoubleParametersTakeLibTorchsOperations) {
  expect_same_run(torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-4), false, torch::kDouble);
}

TEST(SgdStep, EachGroupUsesItsOwnOptions) {
  auto a = optimizer_test::make_params(7);
  auto b = clones(a);
  auto groups = [](std::vector<torch::Tensor>& ps) {
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(std::vector<torch::Tensor>{ps[0], ps[1]}, std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.1)));
    g.emplace_back(std::vector<torch::Tensor>{ps[2], ps[3]},
                   std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.01).momentum(0.5)));
    return g;
  };
  torch::optim::SGD ref(groups(a), torch::optim::SGDOptions(1.0)), fused(groups(b), torch::optim::SGDOptions(1.0));
  for (int step = 0; step < 4; ++step) {
    set_grads(a, step, false);
    set_grads(b, step, false);
    ref.step();
    ct::sgd_step(fused);
  }
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::allclose(a[i], b[i], 1e-6, 1e-6)) << "parameter " << i;
}

TEST(SgdStep, NonContiguousParameterTakesLibTorchsOperations) {
  auto base_a = torch::randn({8, 6}), base_b = base_a.clone();
  auto a = base_a.t().requires_grad_(true), b = base_b.t().requires_grad_(true);  // transposed: not contiguous
  torch::optim::SGD ref({a}, torch::optim::SGDOptions(0.1).momentum(0.9)), fused({b}, torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(step);
    auto g = torch::randn({6, 8});
    a.mutable_grad() = g.clone();
    b.mutable_grad() = g.clone();
    ref.step();
    ct::sgd_step(fused);
  }
  EXPECT_TRUE(torch::allclose(a, b, 1e-6, 1e-6));
}

// The state is LibTorch's own: after fused steps, SGD::step() and the
// checkpoint helpers carry on from the same momentum buffers.
TEST(SgdStep, StateIsTheOptimizersOwn) {
  auto a = optimizer_test::make_params(7);
  auto b = clones(a);
  const auto o = torch::optim::SGDOptions(0.05).momentum(0.9);
  torch::optim::SGD ref(a, o), mixed(b, o);
  for (int step = 0; step < 4; ++step) {
    set_grads(a, step, false);
    set_grads(b, step, false);
    ref.step();
    if (step < 2) ct::sgd_step(mixed);
    else mixed.step();
  }
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::allclose(a[i], b[i], 1e-6, 1e-6)) << "parameter " << i;
  auto saved = ct::optimizer_state(mixed);
  size_t buffers = 0;
  for (const auto& t : saved) buffers += t.name.find("momentum_buffer") != std::string::npos;
  EXPECT_EQ(buffers, a.size());
}

TEST(SgdStep, SparseGradientIsRefused) {
  auto p = torch::randn({4, 3}).requires_grad_(true);
  torch::optim::SGD opt({p}, torch::optim::SGDOptions(0.1));
  p.mutable_grad() = torch::randn({4, 3}).to_sparse();
  try {
    ct::sgd_step(opt);
    FAIL() << "a sparse gradient was accepted";
  } catch (const cohort::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("sparse"), std::string::npos) << e.what();
  }
}

}  // namespace
