// The key LibTorch's optimizers file a parameter's state under
// (Optimizer::state()): the address of its TensorImpl, as a string in
// LibTorch 1.x, as the pointer itself in 2.x. The key type is read from the
// map, so one source builds against both.
#pragma once

#include <torch/torch.h>

#include <sstream>
#include <string>
#include <type_traits>

namespace cohort::torch {

using OptimizerStateKey =
    typename std::remove_cvref_t<decltype(std::declval<::torch::optim::Optimizer&>().state())>::key_type;

// A template so that only the branch for this LibTorch's key is compiled.
template <class Key = OptimizerStateKey>
Key state_key(const ::torch::Tensor& p) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream s;
    s << p.unsafeGetTensorImpl();
    return s.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

}  // namespace cohort::torch
