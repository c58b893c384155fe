// cohort/torch_recompute.hpp: activation recomputation for LibTorch modules.
//
// Training keeps every intermediate tensor of the forward pass until
// backward uses it: for a transformer block that is tens of bytes per token
// per hidden unit, and for deep models it is what runs out of memory first.
// recompute(fn, x) runs fn(x) without keeping its intermediates, keeps only
// x, and in backward runs fn again (with gradients) and backpropagates through
// that second run (Chen et al., "Training Deep Nets with Sublinear Memory
// Cost", 2016; Megatron-LM's full recomputation per transformer layer). The
// price is one more forward pass of fn in backward: about a third more
// compute for a whole model (cohort plan --recompute counts it).
//
// Dropout inside fn draws the same masks in both runs: the states of the
// random generators it uses are saved before the first run and set again for
// the second, then put back. The default generator of x's device is always
// included; pass the others (tp::DropoutRng's) in `generators`.
//
// The second run also has the autocast state of the first (an Autocast
// scope around the forward), so both compute in the same dtypes.
//
// Works under DistributedDataParallel, ZeroOptimizer and tensor parallelism
// (the collectives of tp layers inside fn run again in backward, on every
// rank alike). Not around FsdpUnit modules: FSDP gathers and frees a unit
// around its own forward and backward (refused by name). fn may read x and
// leaf tensors (the parameters, buffers, constants), all on x's device: a
// captured tensor that has a history of its own would be backpropagated
// through in the nested backward, and a parameter on another device would
// have its gradient hook run on another thread than the nested backward's.
// Backward with create_graph (a gradient of a gradient) is refused.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <vector>

#include "cohort/export.hpp"

namespace cohort::torch {

using RecomputeFn = std::function<::torch::Tensor(const ::torch::Tensor&)>;

// fn(x), its intermediate tensors dropped and recomputed in backward. fn is
// kept until then: capture modules by value (their shared_ptr), not by
// reference to a local. It must compute the same thing when run again (no
// in-place change of x, no state it updates: a BatchNorm in training mode
// would count its batch twice). Without grad mode (evaluation) it is fn(x).
// InvalidArgument for an empty fn, an undefined x, or an output that is not
// a floating-point tensor; Error when x was changed in place before backward
// (the recomputation would see other values) or for a second backward
// through the same call (retain_graph).
COHORT_API ::torch::Tensor recompute(RecomputeFn fn, const ::torch::Tensor& x,
                                     std::vector<at::Generator> generators = {});

}  // namespace cohort::torch
