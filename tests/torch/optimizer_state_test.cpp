// optimizer_state / load_optimizer_state: SGD, Adam and AdamW (with amsgrad)
// state saved after a few steps and loaded into a fresh optimizer continues
// exactly as the original; a state of the wrong kind, a damaged one and an
// unsupported optimizer are refused with InvalidArgument.
#include <gtest/gtest.h>

#include "cohort/error.hpp"
#include "cohort/torch_train.hpp"
#include "torch/optimizer_test_util.hpp"

namespace {

namespace ct = cohort::torch;
using optimizer_test::clones;

void step_with_grads(torch::optim::Optimizer& opt, std::vector<torch::Tensor>& ps, int step) {
  optimizer_test::set_grads(ps, step, false);
  opt.step();
}

// Runs 3 steps, saves, loads into a fresh optimizer (`make` builds one over
// the given parameters) on copies of the parameters, then runs 3 more steps
// on both: they must stay bit-identical.
template <class Make>
void expect_round_trip(Make make) {
  auto a = optimizer_test::make_params(3);
  auto opt_a = make(a);
  for (int s = 0; s < 3; ++s) step_with_grads(*opt_a, a, s);
  auto saved = ct::optimizer_state(*opt_a);
  auto b = clones(a);
  auto opt_b = make(b);
  ct::load_optimizer_state(*opt_b, saved);
  for (int s = 3; s < 6; ++s) {
    step_with_grads(*opt_a, a, s);
    step_with_grads(*opt_b, b, s);
  }
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "parameter " << i;
}

TEST(OptimizerState, SgdRoundTrip) {
  expect_round_trip([](std::vector<torch::Tensor>& ps) {
    return std::make_unique<torch::optim::SGD>(ps, torch::optim::SGDOptions(0.1).momentum(0.9));
  });
}

TEST(OptimizerState, AdamRoundTrip) {
  expect_round_trip([](std::vector<torch::Tensor>& ps) {
    return std::make_unique<torch::optim::Adam>(ps, torch::optim::AdamOptions(0.01).weight_decay(0.01));
  });
}

// amsgrad's running maximum is part of the state: without it the resumed
// run would normalise by a smaller second moment.
TEST(OptimizerState, AdamWWithAmsgradRoundTrip) {
  expect_round_trip([](std::vector<torch::Tensor>& ps) {
    return std::make_unique<torch::optim::AdamW>(ps, torch::optim::AdamWOptions(0.01).amsgrad(true));
  });
}

TEST(OptimizerState, SgdStateIntoAdamWIsRefused) {
  auto a = optimizer_test::make_params(3);
  torch::optim::SGD sgd(a, torch::optim::SGDOptions(0.1).momentum(0.9));
  step_with_grads(sgd, a, 0);
  auto b = clones(a);
  torch::optim::AdamW adamw(b, torch::optim::AdamWOptions(0.01));
  try {
    ct::load_optimizer_state(adamw, ct::optimizer_state(sgd));
    FAIL() << "SGD state was loaded into AdamW";
  } catch (const cohort::InvalidArgument& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("SGD"), std::string::npos) << m;
    EXPECT_NE(m.find("AdamW"), std::string::npos) << m;
  }
}

TEST(OptimizerState, DamagedAdamStateNamesTheMissingTensor) {
  auto a = optimizer_test::make_params(3);
  torch::optim::Adam adam(a, torch::optim::AdamOptions(0.01));
  step_with_grads(adam, a, 0);
  auto saved = ct::optimizer_state(adam);
  std::erase_if(saved, [](const cohort::NamedTensor& t) { return t.name == "group0.param1.exp_avg_sq"; });
  torch::optim::Adam fresh(clones(a), torch::optim::AdamOptions(0.01));
  try {
    ct::load_optimizer_state(fresh, saved);
    FAIL() << "a state without exp_avg_sq was loaded";
  } catch (const cohort::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("group0.param1.exp_avg_sq"), std::string::npos) << e.what();
  }
}

// State is saved by position: a state of another model (more parameters, or
// other shapes at the same positions) is refused instead of handing one
// parameter's momentum to another.
TEST(OptimizerState, StateOfAnotherModelIsRefused) {
  auto a = optimizer_test::make_params(3);
  torch::optim::SGD sgd(a, torch::optim::SGDOptions(0.1).momentum(0.9));
  step_with_grads(sgd, a, 0);
  const auto saved = ct::optimizer_state(sgd);
  auto fewer = clones(a);
  fewer.pop_back();
  torch::optim::SGD sgd_fewer(fewer, torch::optim::SGDOptions(0.1).momentum(0.9));
  try {
    ct::load_optimizer_state(sgd_fewer, saved);
    FAIL() << "the state of 4 parameters was loaded into an optimizer of 3";
  } catch (const cohort::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("group 0 has 3 parameter(s)"), std::string::npos) << e.what();
  }
  std::vector<torch::Tensor> reshaped;
  for (auto& p : a) reshaped.push_back(torch::zeros({p.numel() + 1}));
  torch::optim::SGD sgd_other(reshaped, torch::optim::SGDOptions(0.1).momentum(0.9));
  try {
    ct::load_optimizer_state(sgd_other, saved);
    FAIL() << "momentum of another shape was loaded";
  } catch (const cohort::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("another model"), std::string::npos) << e.what();
  }
}

TEST(OptimizerState, UnsupportedOptimizerIsRefused) {
  auto a = optimizer_test::make_params(3);
  torch::optim::RMSprop rms(a, torch::optim::RMSpropOptions(0.01));
  EXPECT_THROW(ct::load_optimizer_state(rms, {}), cohort::InvalidArgument);
}

}  // namespace
