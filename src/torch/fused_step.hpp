// What the fused optimizer steps (fused_sgd.cpp, fused_adam.cpp) share: the
// CPU check for their AVX2+FMA loops and the test for tensors the loops take.
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace cohort::torch {

#if defined(__x86_64__)
inline bool have_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#endif

// Dense, contiguous float32 on the CPU with `numel` elements: what the fused
// loops handle. Anything else takes LibTorch's own operations.
inline bool is_plain_float(const ::torch::Tensor& t, int64_t numel) {
  return t.device().is_cpu() && t.layout() == ::torch::kStrided && t.scalar_type() == ::torch::kFloat && t.is_contiguous() &&
         t.numel() == numel;
}

}  // namespace cohort::torch
