// Shared by the optimizer tests (sgd_step, adam_step, optimizer_state): two
// identical sets of parameters that get identical gradients, step by step.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace optimizer_test {

// Sizes that leave vector remainders (7, 13, 1001) and one that does not (64).
inline std::vector<torch::Tensor> make_params(uint64_t seed, torch::Dtype dtype = torch::kFloat) {
  torch::manual_seed(seed);
  std::vector<torch::Tensor> ps;
  for (auto shape : std::vector<std::vector<int64_t>>{{7}, {13, 1}, {64}, {1001}})
    ps.push_back(torch::randn(shape, torch::dtype(dtype)).requires_grad_(true));
  return ps;
}

inline std::vector<torch::Tensor> clones(const std::vector<torch::Tensor>& ps) {
  std::vector<torch::Tensor> out;
  for (const auto& p : ps) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

// The gradients of step `step` (the same for every caller that passes the
// same step). Their scale changes from step to step, so that moment estimates
// and amsgrad's maximum matter. With skip_one, parameter 1 gets none on odd
// steps: it must not move then.
inline void set_grads(std::vector<torch::Tensor>& ps, int step, bool skip_one) {
  torch::manual_seed(100 + step);
  for (size_t i = 0; i < ps.size(); ++i) {
    if (skip_one && i == 1 && step % 2 == 1) {
      ps[i].mutable_grad() = torch::Tensor();
      continue;
    }
    ps[i].mutable_grad() = torch::randn_like(ps[i]) * (step % 3 == 0 ? 2.0 : 0.3);
  }
}

}  // namespace optimizer_test
