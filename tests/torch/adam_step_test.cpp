// cohort::torch::adam_step / adamw_step against torch::optim::Adam::step() and
// AdamW::step(): two copies of the same parameters get the same gradients for
// several steps, one stepped by LibTorch and one by cohort; parameters, both
// moments (and amsgrad's maximum) and the step count must agree.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "cohort/error.hpp"
#include "cohort/torch_train.hpp"
#include "torch/optimizer_test_util.hpp"
#include "torch/state_key.hpp"

namespace {

namespace ct = cohort::torch;
using optimizer_test::clones;
using optimizer_test::set_grads;
using torch::optim::Adam;
using torch::optim::AdamOptions;
using torch::optim::AdamW;
using torch::optim::AdamWOptions;


template <class State, class Opt>
const State* state_of(Opt& opt, const torch::Tensor& p) {
  auto it = opt.state().find(cohort::torch::state_key(p));
  return it == opt.state().end() ? nullptr : static_cast<const State*>(it->second.get());
}

void expect_close(const torch::Tensor& a, const torch::Tensor& b, const char* what) {
  ASSERT_EQ(a.defined(), b.defined()) << what;
  if (!a.defined()) return;
  EXPECT_TRUE(torch::allclose(a, b, 1e-5, 1e-6)) << what << ": max difference " << (a - b).abs().max().item<double>();
}

template <class Opt, class State>
void expect_same_states(Opt& ref, Opt& fused, const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    SCOPED_TRACE("parameter " + std::to_string(i));
    expect_close(a[i], b[i], "parameter");
    const State* sa = state_of<State>(ref, a[i]);
    const State* sb = state_of<State>(fused, b[i]);
    ASSERT_EQ(sa == nullptr, sb == nullptr);
    if (sa == nullptr) continue;
    EXPECT_EQ(sa->step(), sb->step());
    expect_close(sa->exp_avg(), sb->exp_avg(), "exp_avg");
    expect_close(sa->exp_avg_sq(), sb->exp_avg_sq(), "exp_avg_sq");
    expect_close(sa->max_exp_avg_sq(), sb->max_exp_avg_sq(), "max_exp_avg_sq");
  }
}

template <class Opt, class Options, class State>
void expect_same_run(const Options& o, void (*step)(Opt&), bool skip_one = false, torch::Dtype dtype = torch::kFloat) {
  auto a = optimizer_test::make_params(11, dtype);
  auto b = clones(a);
  Opt ref(a, o), fused(b, o);
  for (int s = 0; s < 8; ++s) {
    set_grads(a, s, skip_one);
    set_grads(b, s, skip_one);
    ref.step();
    step(fused);
  }
  expect_same_states<Opt, State>(ref, fused, a, b);
}

void adam(const AdamOptions& o, bool skip_one = false, torch::Dtype dtype = torch::kFloat) {
  expect_same_run<Adam, AdamOptions, torch::optim::AdamParamState>(o, ct::adam_step, skip_one, dtype);
}
void adamw(const AdamWOptions& o, bool skip_one = false, torch::Dtype dtype = torch::kFloat) {
  expect_same_run<AdamW, AdamWOptions, torch::optim::AdamWParamState>(o, ct::adamw_step, skip_one, dtype);
}

TEST(AdamStep, Defaults) { adam(AdamOptions()); }
TEST(AdamStep, WeightDecayIsAddedToTheGradient) { adam(AdamOptions(0.01).weight_decay(0.1)); }
TEST(AdamStep, Amsgrad) { adam(AdamOptions(0.01).amsgrad(true).betas({0.8, 0.99}).eps(1e-6)); }
TEST(AdamStep, ParameterWithoutGradientStaysPut) { adam(AdamOptions(0.01), true); }
TEST(AdamStep, DoubleParametersTakeLibTorchsOperations) { adam(AdamOptions(0.01).weight_decay(1e-2), false, torch::kDouble); }

TEST(AdamWStep, Defaults) { adamw(AdamWOptions()); }
TEST(AdamWStep, DecoupledWeightDecay) { adamw(AdamWOptions(0.01).weight_decay(0.1)); }
TEST(AdamWStep, AmsgradWithoutWeightDecay) { adamw(AdamWOptions(0.01).amsgrad(true).weight_decay(0)); }
TEST(AdamWStep, ParameterWithoutGradientStaysPut) { adamw(AdamWOptions(0.01).amsgrad(true), true); }
TEST(AdamWStep, DoubleParametersTakeLibTorchsOperations) { adamw(AdamWOptions(0.01).amsgrad(true), false, torch::kDouble); }

TEST(AdamWStep, EachGroupUsesItsOwnOptions) {
  auto a = optimizer_test::make_params(11);
  auto b = clones(a);
  auto groups = [](std::vector<torch::Tensor>& ps) {
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(std::vector<torch::Tensor>{ps[0], ps[1]}, std::make_unique<AdamWOptions>(AdamWOptions(0.02).weight_decay(0)));
    g.emplace_back(std::vector<torch::Tensor>{ps[2], ps[3]},
                   std::make_unique<AdamWOptions>(AdamWOptions(0.005).betas({0.5, 0.9}).amsgrad(true)));
    return g;
  };
  AdamW ref(groups(a), AdamWOptions(1.0)), fused(groups(b), AdamWOptions(1.0));
  for (int s = 0; s < 5; ++s) {
    set_grads(a, s, false);
    set_grads(b, s, false);
    ref.step();
    ct::adamw_step(fused);
  }
  expect_same_states<AdamW, torch::optim::AdamWParamState>(ref, fused, a, b);
}

TEST(AdamStep, NonContiguousParameterTakesLibTorchsOperations) {
  auto base_a = torch::randn({8, 6}), base_b = base_a.clone();
  auto a = base_a.t().requires_grad_(true), b = base_b.t().requires_grad_(true);  // transposed: not contiguous
  Adam ref({a}, AdamOptions(0.01).weight_decay(0.01)), fused({b}, AdamOptions(0.01).weight_decay(0.01));
  for (int s = 0; s < 3; ++s) {
    torch::manual_seed(s);
    auto g = torch::randn({6, 8});
    a.mutable_grad() = g.clone();
    b.mutable_grad() = g.clone();
    ref.step();
    ct::adam_step(fused);
  }
  expect_close(a, b, "parameter");
}

// The state is LibTorch's own: after fused steps, step() and the checkpoint
// helpers carry on from the same moments and step count.
TEST(AdamWStep, StateIsTheOptimizersOwn) {
  auto a = optimizer_test::make_params(11);
  auto b = clones(a);
  const auto o = AdamWOptions(0.01).weight_decay(0.05);
  AdamW ref(a, o), mixed(b, o);
  for (int s = 0; s < 6; ++s) {
    set_grads(a, s, false);
    set_grads(b, s, false);
    ref.step();
    if (s % 2 == 0) ct::adamw_step(mixed);
    else mixed.step();
  }
  expect_same_states<AdamW, torch::optim::AdamWParamState>(ref, mixed, a, b);
  auto saved = ct::optimizer_state(mixed);
  size_t moments = 0;
  for (const auto& t : saved) moments += t.name.find("exp_avg_sq") != std::string::npos;
  EXPECT_EQ(moments, a.size());
}

// A NaN gradient element poisons that element (parameter, moments, amsgrad's
// maximum) exactly as step() does, in the vector loop and in its scalar tail.
TEST(AdamWStep, NanGradientPropagatesAsInStep) {
  auto a = optimizer_test::make_params(11);
  auto b = clones(a);
  const auto o = AdamWOptions(0.01).amsgrad(true);
  AdamW ref(a, o), fused(b, o);
  for (int s = 0; s < 3; ++s) {
    set_grads(a, s, false);
    set_grads(b, s, false);
    if (s == 1)
      for (auto* ps : {&a, &b})
        for (auto& p : *ps) p.mutable_grad().view(-1)[3] = std::numeric_limits<float>::quiet_NaN();
    ref.step();
    ct::adamw_step(fused);
  }
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::allclose(a[i], b[i], 1e-5, 1e-6, /*equal_nan=*/true)) << "parameter " << i;
    EXPECT_TRUE(std::isnan(b[i].view(-1)[3].item<float>())) << "parameter " << i;
    const auto* sa = state_of<torch::optim::AdamWParamState>(ref, a[i]);
    const auto* sb = state_of<torch::optim::AdamWParamState>(fused, b[i]);
    ASSERT_TRUE(sa != nullptr && sb != nullptr);
    EXPECT_TRUE(torch::allclose(sa->max_exp_avg_sq(), sb->max_exp_avg_sq(), 1e-5, 1e-6, true)) << "parameter " << i;
  }
}

TEST(AdamStep, SparseGradientIsRefused) {
  auto p = torch::randn({4, 3}).requires_grad_(true);
  Adam opt({p}, AdamOptions(0.1));
  p.mutable_grad() = torch::randn({4, 3}).to_sparse();
  try {
    ct::adam_step(opt);
    FAIL() << "a sparse gradient was accepted";
  } catch (const cohort::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("sparse"), std::string::npos) << e.what();
  }
}

TEST(AdamWStep, BetaOfOneIsRefused) {
  auto p = torch::randn({5}).requires_grad_(true);
  auto before = p.detach().clone();
  AdamW opt({p}, AdamWOptions(0.1));
  static_cast<AdamWOptions&>(opt.param_groups()[0].options()).betas({0.9, 1.0});  // set after construction
  p.mutable_grad() = torch::randn({5});
  try {
    ct::adamw_step(opt);
    FAIL() << "beta2 = 1 was accepted";
  } catch (const cohort::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("betas"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(torch::equal(p.detach(), before)) << "the refused step must not move the parameter";
  EXPECT_TRUE(opt.state().empty());
}

}  // namespace
