// cohort/torch_tensor_parallel.hpp: tensor-parallel layers for LibTorch
// (Shoeybi et al., "Megatron-LM", 2019; sequence parallelism: Korthikanti et
// al., "Reducing Activation Recomputation in Large Transformer Models", 2022).
//
// A transformer block's two matrix products are split across the ranks of a
// tensor-parallel group (Mesh::tp()) so that each rank holds 1/tp of the
// weights and the block needs one allreduce in forward and one in backward:
//
//   MLP:        x ──enter──> ColumnParallelLinear (h -> 4h, output columns split)
//                            gelu (on the local columns, no communication)
//                            RowParallelLinear (4h -> h, input rows split) ──leave (allreduce)──> y
//   attention:  the same with the heads split: q, k, v column-parallel, the
//               output projection row-parallel.
//
// `enter` is the identity forward and an allreduce of the gradient backward;
// `leave` the reverse. With sequence parallelism the activations between
// blocks are split along the sequence instead of replicated: `leave` becomes a
// reduce-scatter and `enter` an allgather (their backwards swap), moving the
// same bytes as one allreduce while the norms and dropout work on 1/tp of the
// tokens. Parameters that sequence parallelism leaves replicated (the norms,
// a row-parallel bias) then see only their tokens' gradient:
// sync_sequence_parallel_grads() sums it across the group.
//
// Every layer builds its full weight first, initialised exactly as the
// unsharded layer would be (by `init`, default: torch::nn::Linear's or
// torch::nn::Embedding's own initialisation from LibTorch's global generator,
// so every rank of the group must have seeded it alike), and keeps its slice:
// a model built at tp 2 holds the slices of the same model built at tp 1.
// The full weight exists only while the layer is built.
//
// Collectives run on the group passed in; every rank of it must run the same
// layers in the same order (as the same model code does). Tensors may live on
// the CPU (native, mpi groups) or on the group's GPU (nccl). The autograd
// functions keep a reference to the group for their backward: the group must
// outlive every graph built through them (the layers hold it).
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <vector>

#include "cohort/checkpoint.hpp"
#include "cohort/export.hpp"
#include "cohort/process_group.hpp"

// TORCH_MODULE names torch::nn unqualified, which inside cohort::torch means
// cohort::torch::nn: the same module holder, spelled out, with a constructor
// that takes the options as a braced list ({.bias = false}).
#define COHORT_TP_MODULE(Name)                                                                              \
  class Name : public ::torch::nn::ModuleHolder<Name##Impl> {                                               \
   public:                                                                                                  \
    using ::torch::nn::ModuleHolder<Name##Impl>::ModuleHolder;                                              \
    Name(std::shared_ptr<ProcessGroup> group, int64_t a, int64_t b, Name##Options opts = {})                \
        : ::torch::nn::ModuleHolder<Name##Impl>(std::make_shared<Name##Impl>(std::move(group), a, b, std::move(opts))) {} \
  }

namespace cohort::torch::tp {

// ---- the communicating autograd functions --------------------------------

// Identity forward; backward allreduces (sums) the gradient over `group`.
// Megatron's "f": where a replicated activation enters a parallel region.
COHORT_API ::torch::Tensor enter(const ::torch::Tensor& x, ProcessGroup& group);
// Allreduce (sum) forward; identity backward. Megatron's "g".
COHORT_API ::torch::Tensor leave(const ::torch::Tensor& x, ProcessGroup& group);
// Forward concatenates the ranks' tensors along `dim` (rank order); backward
// keeps this rank's slice of the gradient.
COHORT_API ::torch::Tensor gather(const ::torch::Tensor& x, ProcessGroup& group, int64_t dim);
// Forward keeps this rank's slice along `dim` (its size must divide by the
// group size); backward concatenates the gradients.
COHORT_API ::torch::Tensor split(const ::torch::Tensor& x, ProcessGroup& group, int64_t dim);
// Sequence parallelism: forward sums over the group and keeps this rank's
// slice along `dim`; backward allgathers along `dim`.
COHORT_API ::torch::Tensor reduce_scatter(const ::torch::Tensor& x, ProcessGroup& group, int64_t dim);
// Sequence parallelism: forward allgathers along `dim`; backward sums the
// gradient over the group and keeps this rank's slice.
COHORT_API ::torch::Tensor allgather(const ::torch::Tensor& x, ProcessGroup& group, int64_t dim);

// ---- layers ---------------------------------------------------------------

// Fills a full (unsharded) weight and bias (bias undefined when the layer has
// none), e.g. from a seeded generator.
using LinearInit = std::function<void(::torch::Tensor& weight, ::torch::Tensor& bias)>;
// torch::nn::Linear's own initialisation: kaiming_uniform(a = sqrt(5)) for the
// weight, uniform(+-1/sqrt(in)) for the bias, from LibTorch's global generator.
COHORT_API void default_linear_init(::torch::Tensor& weight, ::torch::Tensor& bias);

struct ColumnParallelLinearOptions {
  bool bias = true;
  // Concatenate the ranks' outputs (allgather) instead of leaving each rank
  // its columns.
  bool gather_output = false;
  // The input is split along the sequence (dimension `sequence_dim`):
  // allgathered in forward, reduce-scattered in backward.
  bool sequence_parallel = false;
  int64_t sequence_dim = 1;
  // The output is `blocks` equal parts (a fused q|k|v projection: 3), each
  // split across the ranks, so that rank r holds part r of every block.
  int64_t blocks = 1;
  LinearInit init;  // empty: default_linear_init
};

// y = x W^T + b with W's output rows split: rank r holds rows
// [r*out/tp, (r+1)*out/tp) (of every block). Input: replicated (or, with
// sequence_parallel, this rank's part of the sequence); output: this rank's
// columns [..., out/tp], or all of them with gather_output.
class COHORT_API ColumnParallelLinearImpl : public ::torch::nn::Module {
 public:
  ColumnParallelLinearImpl(std::shared_ptr<ProcessGroup> group, int64_t in, int64_t out,
                           ColumnParallelLinearOptions opts = {});
  ::torch::Tensor forward(const ::torch::Tensor& x);
  // forward() without the communication at the input: for several layers that
  // read one input which the caller passed through enter() (or allgather()) once.
  ::torch::Tensor forward_local(const ::torch::Tensor& x);
  ::torch::Tensor weight, bias;  // [out/tp, in], [out/tp]
  ProcessGroup& group() const { return *group_; }
  const ColumnParallelLinearOptions& options() const { return opts_; }

 private:
  std::shared_ptr<ProcessGroup> group_;
  ColumnParallelLinearOptions opts_;
};
COHORT_TP_MODULE(ColumnParallelLinear);

struct RowParallelLinearOptions {
  bool bias = true;
  // The input holds this rank's slice of the features already (the output of
  // a ColumnParallelLinear); false splits a replicated input first.
  bool input_is_parallel = true;
  // Reduce-scatter the output along `sequence_dim` instead of allreducing it.
  bool sequence_parallel = false;
  int64_t sequence_dim = 1;
  LinearInit init;
};

// y = x W^T + b with W's input columns split: rank r holds columns
// [r*in/tp, (r+1)*in/tp); the partial products are summed over the group
// (allreduce, or reduce-scatter with sequence_parallel), then the replicated
// bias is added.
class COHORT_API RowParallelLinearImpl : public ::torch::nn::Module {
 public:
  RowParallelLinearImpl(std::shared_ptr<ProcessGroup> group, int64_t in, int64_t out, RowParallelLinearOptions opts = {});
  ::torch::Tensor forward(const ::torch::Tensor& x);
  ::torch::Tensor weight, bias;  // [out, in/tp], [out] (replicated)
  ProcessGroup& group() const { return *group_; }
  const RowParallelLinearOptions& options() const { return opts_; }

 private:
  std::shared_ptr<ProcessGroup> group_;
  RowParallelLinearOptions opts_;
};
COHORT_TP_MODULE(RowParallelLinear);

struct VocabParallelEmbeddingOptions {
  // Reduce-scatter the output along `sequence_dim` instead of allreducing it.
  bool sequence_parallel = false;
  int64_t sequence_dim = 1;
  // Fills the full [vocab, dim] table; empty: normal(0, 1), torch::nn::Embedding's.
  std::function<void(::torch::Tensor& weight)> init;
};

// An embedding table whose rows (the vocabulary) are split: rank r holds
// tokens [r*vocab/tp, (r+1)*vocab/tp), looks up those it holds, writes zeros
// for the others, and the ranks' rows are summed.
class COHORT_API VocabParallelEmbeddingImpl : public ::torch::nn::Module {
 public:
  VocabParallelEmbeddingImpl(std::shared_ptr<ProcessGroup> group, int64_t vocab, int64_t dim,
                             VocabParallelEmbeddingOptions opts = {});
  ::torch::Tensor forward(const ::torch::Tensor& ids);
  ::torch::Tensor weight;  // [vocab/tp, dim]
  int64_t first_token() const { return first_; }
  ProcessGroup& group() const { return *group_; }

 private:
  std::shared_ptr<ProcessGroup> group_;
  VocabParallelEmbeddingOptions opts_;
  int64_t first_ = 0;
};
COHORT_TP_MODULE(VocabParallelEmbedding);

// The cross-entropy of logits whose vocabulary is split over `group`:
// `local_logits` [N, vocab/tp] are this rank's columns (rank r holds tokens
// [r*vocab/tp, ...)), `targets` [N] the global token ids. Returns the loss per
// row [N], as torch::nn::functional::cross_entropy with reduction none would
// on the full logits; no rank ever holds the full logits (forward: an
// allreduce of N row maxima and one of 2N sums; none backward). Targets are
// int64 ids in [0, vocab): others (ignore_index -100 included) throw
// InvalidArgument.
COHORT_API ::torch::Tensor vocab_parallel_cross_entropy(const ::torch::Tensor& local_logits,
                                                        const ::torch::Tensor& targets, ProcessGroup& group);

// ---- dropout ----------------------------------------------------------------

// The random streams dropout draws from in a tensor-parallel model. Where the
// activations are split across the group (attention heads, the tokens of
// sequence parallelism) each rank must draw its own mask: parallel(). Where
// they are replicated (the residual stream without sequence parallelism)
// every rank of the group must draw the same mask, or the replicas drift
// apart: replicated(). `seed` is the same on every rank of the job;
// `replica` differs between the groups that should draw different masks
// (e.g. dp rank and pipeline stage), so data-parallel replicas do not share
// masks. (Megatron-LM keeps the same two streams in its "model-parallel RNG
// tracker".)
class COHORT_API DropoutRng {
 public:
  DropoutRng(uint64_t seed, const ProcessGroup& tp_group, uint64_t replica = 0);
  at::Generator& replicated() { return replicated_; }
  at::Generator& parallel() { return parallel_; }

 private:
  at::Generator replicated_, parallel_;
};

// Zeroes each element with probability p (mask drawn from `gen`, on the CPU)
// and scales the rest by 1/(1-p); the identity when !training or p == 0.
COHORT_API ::torch::Tensor dropout(const ::torch::Tensor& x, double p, at::Generator& gen, bool training);

// ---- the model around the layers -------------------------------------------

// The parameters of `module` split into those the tensor-parallel layers
// shard (each rank holds a different slice) and the rest, replicated on every
// rank of the group (norms, position embeddings, row-parallel biases).
struct COHORT_API ParameterSplit {
  std::vector<::torch::Tensor> sharded, replicated;
};
COHORT_API ParameterSplit split_parameters(::torch::nn::Module& module);

// The global L2 norm of the gradients of `module`'s parameters over the ranks
// that hold one replica (Mesh::model_parallel(): tp x pp): each sharded slice
// counted once, each replicated parameter once (by tp rank 0 of `tp_rank`).
// Scales the gradients by max_norm / norm when the norm exceeds max_norm (a
// max_norm <= 0 only measures). Returns the norm before clipping, as
// torch::nn::utils::clip_grad_norm_ does.
COHORT_API double clip_grad_norm(::torch::nn::Module& module, double max_norm, ProcessGroup& model_parallel,
                                 int tp_rank);

// With sequence parallelism, sums over `group` the gradients of the
// parameters that see only this rank's tokens. The module form sums every
// replicated parameter of split_parameters (norms, position table,
// row-parallel biases): right when all of them are used inside the
// sequence-parallel region, as in examples/gpt; a replicated parameter used
// on the whole sequence (a norm after a gathered output) would come out tp
// times too large: list the right ones with the second form. Call after
// backward, before clipping and the optimizer step. Undefined gradients are
// left so.
COHORT_API void sync_sequence_parallel_grads(::torch::nn::Module& module, ProcessGroup& group);
COHORT_API void sync_sequence_parallel_grads(const std::vector<::torch::Tensor>& params, ProcessGroup& group);

// ---- checkpoints at any layout -----------------------------------------------

// The model's parameters and buffers by name, as cohort::torch::module_state
// gives them, with every sharded parameter gathered into the full tensor of
// the unsharded model: what a checkpoint stores so that it loads at another
// tensor-parallel degree (or in one process). Collective over the group of
// the tensor-parallel layers (every rank gets the full state).
COHORT_API std::vector<NamedTensor> full_module_state(::torch::nn::Module& module);
// Loads full tensors (from full_module_state, or from the unsharded model's
// module_state) into a model built at any tensor-parallel degree: each rank
// keeps its slice. No communication. Throws InvalidArgument naming a missing
// tensor or a shape that is not the full one.
COHORT_API void load_full_module_state(::torch::nn::Module& module, const std::vector<NamedTensor>& tensors);

// The optimizer's state for `module`'s parameters (SGD's momentum buffers;
// Adam's and AdamW's moments and step counts, as cohort::torch::
// optimizer_state saves them), named by parameter ("block3.fc1.weight.exp_avg")
// and gathered into full tensors as full_module_state does, plus each param
// group's learning rate ("group0.lr"). Parameters of the optimizer that are
// not in `module` (another pipeline stage's) are left out, so each stage
// saves its own. Collective over the tensor-parallel group.
COHORT_API std::vector<NamedTensor> full_optimizer_state(::torch::nn::Module& module,
                                                         ::torch::optim::Optimizer& optimizer);
// Loads such a state (from any layout) for `module`'s parameters into
// `optimizer`, whatever its param groups: each rank keeps its slices. No
// communication. Also takes optimizer_state() of one group over `module`'s
// trainable parameters() in order (DDP's and one process's; ZeRO's and
// FSDP's full state): "group0.param<i>" is the i-th trainable parameter's,
// and that group's learning rate is not applied (this optimizer's groups
// are others; a state by name sets each group's).
// Throws InvalidArgument as load_optimizer_state does (another optimizer, a
// shape that does not fit), and for positions in a second group.
// On a model without tensor-parallel layers this pair (full_optimizer_state
// too) is a plain renaming: the way to move a grouped optimizer's state
// (weight decay off for biases and norms) between one process, DDP, ZeRO
// and FSDP.
COHORT_API void load_full_optimizer_state(::torch::nn::Module& module, ::torch::optim::Optimizer& optimizer,
                                          const std::vector<NamedTensor>& tensors);

}  // namespace cohort::torch::tp
