// The key LibTorch's optimizers file a parameter's state under
// (Optimizer::state(): the address of its TensorImpl, as a string).
#pragma once

#include <torch/torch.h>

#include <sstream>
#include <string>

namespace cohort::torch {

inline std::string state_key(const ::torch::Tensor& p) {
  std::ostringstream s;
  s << p.unsafeGetTensorImpl();
  return s.str();
}

}  // namespace cohort::torch
