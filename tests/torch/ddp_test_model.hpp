// The small model and data the DDP tests share (ddp_test.cpp on the CPU,
// ddp_cuda_test.cpp on a GPU): deterministic weights and samples, so that
// thread-ranks and a single reference process compute the same numbers.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <memory>

#include "cohort/process_group.hpp"

namespace ddp_test {

struct NetImpl : torch::nn::Module {
  explicit NetImpl(bool with_unused = false) {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
    if (with_unused) spare = register_module("spare", torch::nn::Linear(4, 4));
    // Deterministic weights (no shared random generator between thread-ranks).
    torch::NoGradGuard g;
    int k = 0;
    for (auto& p : parameters()) {
      auto flat = p.view({-1});
      for (int64_t i = 0; i < flat.numel(); ++i) flat[i] = std::sin(0.37 * (k++)) * 0.5;
    }
  }
  torch::Tensor forward(torch::Tensor x) { return fc2->forward(torch::tanh(fc1->forward(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, spare{nullptr};
};
TORCH_MODULE(Net);

// Samples [from, from + n) of the global batch, and their targets (CPU).
inline torch::Tensor inputs(int64_t from, int64_t n) {
  auto x = torch::empty({n, 8});
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < 8; ++j) x[i][j] = std::cos(0.11 * ((from + i) * 8 + j));
  return x;
}
inline torch::Tensor targets(int64_t from, int64_t n) {
  auto y = torch::empty({n, 4});
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < 4; ++j) y[i][j] = std::sin(0.07 * ((from + i) * 4 + j));
  return y;
}

// The group as DDP takes it (a shared_ptr), without owning it: run_ranks does.
inline std::shared_ptr<cohort::ProcessGroup> borrowed(cohort::ProcessGroup& pg) {
  return std::shared_ptr<cohort::ProcessGroup>(&pg, [](cohort::ProcessGroup*) {});
}

}  // namespace ddp_test
