// cohort/torch_zero.hpp: ZeRO-1 and ZeRO-2 for LibTorch: data parallelism
// whose optimizer state (and, for ZeRO-2, reduced gradients) is split across
// the ranks instead of replicated (Rajbhandari et al., "ZeRO: Memory
// Optimizations Toward Training Trillion Parameter Models", SC 2020).
//
//   auto pg = cohort::init_process_group();
//   auto model = std::make_shared<Net>();
//   cohort::torch::ZeroOptimizer opt(model, pg, torch::optim::AdamWOptions(1e-3),
//                                    {.stage = cohort::torch::ZeroStage::Two});
//   for (batch : loader) {
//     opt.zero_grad();
//     opt.pre_forward();                   // broadcasts buffers, as DDP's
//     auto loss = loss_fn(model->forward(x), y);
//     loss.backward();                     // ZeRO-2: each bucket is reduce-scattered as it fills
//     opt.clip_grad_norm(1.0);             // optional: the norm of the whole (global) gradient
//     opt.step();                          // steps this rank's shard, then allgathers the parameters
//   }
//
// Layout (docs/zero.md): the trainable parameters are packed into DDP's
// buckets (reverse registration order, bucket_cap_mb), each padded to a
// multiple of the world size N. Rank r owns chunk r of every bucket: it keeps
// the optimizer state of those elements only, and after its step the
// buckets are allgathered in place. The module's parameters become views of
// one flat buffer (shared memory on one host, so the allgather and the
// reduce_scatter take the single-copy path; GPU memory for a module on a
// GPU), so they change with no copy.
//
//   ZeRO-1: gradients accumulate in full on every rank over any number of
//           backward passes; step() reduce-scatters them once (per bucket).
//   ZeRO-2: every synced backward reduce-scatters each bucket as soon as its
//           gradients are ready (overlapping backward, as DDP's allreduce
//           does) and adds this rank's chunk to a gradient shard of 1/N of
//           the size. Each gradient is freed once copied into its bucket,
//           and a bucket's buffer is reused once reduced (grad_buffers of
//           them), so no rank holds the whole gradient. no_sync()
//           accumulates in .grad instead (full size, as in DDP).
//
// After backward, .grad of the module's parameters is not the averaged
// gradient (ZeRO-1: this rank's own; ZeRO-2: none): clip and inspect through
// this class, which sees the reduced shard. A parameter that gets no gradient
// counts as a zero gradient (its Adam moments still decay), as in DeepSpeed.
#pragma once

#include <torch/torch.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "cohort/checkpoint.hpp"
#include "cohort/export.hpp"
#include "cohort/process_group.hpp"
#include "cohort/torch.hpp"
#include "cohort/torch_train.hpp"

namespace cohort::torch {

enum class ZeroStage { One = 1, Two = 2 };

// The optimizer each rank runs on its shard, with these options: its fused
// step (sgd_step, adam_step, adamw_step).
using ShardOptimizerOptions =
    std::variant<::torch::optim::SGDOptions, ::torch::optim::AdamOptions, ::torch::optim::AdamWOptions>;

// Parameters that step with options of their own, as a param group of
// PyTorch's optimizers: typically weight decay off for biases and norms. The
// parameters are named as module->named_parameters() names them; every
// trainable parameter that no group names steps with the constructor's
// options (the first group). Same optimizer kind as those options.
struct COHORT_API ZeroParamGroup {
  std::vector<std::string> names;
  ShardOptimizerOptions options;
};

struct COHORT_API ZeroOptions {
  ZeroStage stage = ZeroStage::Two;
  double bucket_cap_mb = 25.0;    // as DDP's: the unit of communication and of sharding
  double first_bucket_mb = 1.0;
  bool find_unused_parameters = false;  // ZeRO-2 only (ZeRO-1 does not reduce during backward)
  bool broadcast_buffers = true;        // rank 0's buffers in pre_forward(), as DDP's
  std::vector<ZeroParamGroup> param_groups;  // groups 1, 2, ... after the constructor's options
  // ZeRO-2: the bucket-sized gradient buffers a rank keeps for backward
  // (ddp::ReducerOptions::recycled_buckets): with 2, one bucket fills while
  // the one before it is reduce-scattered; more lets more reductions overlap
  // backward. The pool grows past it only when gradients arrive out of bucket
  // order. At least 1.
  size_t grad_buffers = 2;
};

// What this rank holds, in elements and bytes.
struct COHORT_API ZeroMemory {
  size_t params = 0;                 // trainable elements of the model
  size_t padded = 0;                 // elements in the buckets, with each bucket's padding
  size_t shard = 0;                  // elements this rank steps (padded / world size)
  size_t param_bytes = 0;            // the flat parameter buffer (a full replica)
  size_t grad_bytes = 0;             // gradient buckets: ZeRO-1 a full replica; ZeRO-2 the buffers used so far
  size_t grad_shard_bytes = 0;       // ZeRO-2's reduced gradient shard (0 for ZeRO-1)
  size_t optimizer_state_bytes = 0;  // this rank's optimizer state tensors (0 before the first step)
};

class COHORT_API ZeroOptimizer {
 public:
  // Collective over `group`, like DistributedDataParallel's constructor: the
  // same checks (every rank has the same parameters), rank 0's parameters and
  // buffers broadcast; then the parameters move into the flat buffer. A
  // module on the CPU with a group that moves host memory (native, mpi), or
  // on this rank's GPU with nccl (the buffers in the GPU's memory,
  // docs/zero.md "On a GPU"); anything else (a GPU module on a host group) is
  // refused by name. Throws InvalidArgument for invalid optimizer options.
  ZeroOptimizer(std::shared_ptr<::torch::nn::Module> module, std::shared_ptr<ProcessGroup> group,
                ShardOptimizerOptions optimizer, ZeroOptions opts = {});
  ~ZeroOptimizer();
  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;

  // Before each training forward (buffers, as DistributedDataParallel's).
  void pre_forward();
  // Backward passes under it accumulate locally; the next synced backward
  // (ZeRO-2) or step() (ZeRO-1) reduces the sum.
  [[nodiscard]] ddp::NoSyncGuard no_sync();
  // Clears the gradients (the buckets and, for ZeRO-2, the shard) before the
  // next accumulation. Call it, not the module's or an optimizer's zero_grad:
  // a backward after the gradients were reduced (clip_grad_norm, unscale,
  // step) and before zero_grad() is refused by the next of those calls.
  void zero_grad();
  // Scales the gradients so that the norm of the whole averaged gradient (all
  // ranks' shards together) is at most max_norm; returns that norm before
  // clipping (the same on every rank). As clip_grad_norm with DDP.
  double clip_grad_norm(double max_norm);
  // Divides the gradient shard by the scaler's scale and checks every rank's
  // shard for inf/NaN (GradScaler::unscale). Optional, before clipping.
  bool unscale(GradScaler& scaler);
  // Steps this rank's shard, then allgathers every bucket of parameters.
  void step();
  // The same through a GradScaler: skipped on every rank when any shard had
  // inf/NaN (the parameters stay as they were); returns whether it stepped.
  bool step(GradScaler& scaler);

  // The first group's learning rate. set_lr sets it, and every other
  // group's to `lr` times the ratio of the two learning rates given at
  // construction: a schedule moves all groups alike. (With the first group
  // constructed at lr 0, the others must be at 0 too, and they follow it.)
  double lr() const;
  void set_lr(double lr);
  // The optimizer that steps the shard: param group g of it is
  // ZeroOptions::param_groups[g - 1] (0: the constructor's options), with one
  // parameter per bucket and group (the elements of this rank's chunk of the
  // bucket that belong to parameters of that group; a group may have none
  // on this rank), its state the shard's. For checkpoints and inspection.
  ::torch::optim::Optimizer& shard_optimizer();
  ZeroMemory memory() const;

  // This rank's part of the optimizer state, one file of a sharded
  // checkpoint (save_checkpoint_sharded): for each bucket b, this rank's
  // chunk of every state tensor ("bucket<b>.exp_avg", "bucket<b>.exp_avg_sq",
  // "bucket<b>.momentum_buffer", ...; the padding included), and
  // "zero.layout" (int64: the world size, the optimizer kind, the steps
  // taken, the bucket count, the two bucket caps in bytes, then each bucket's
  // elements without and with padding), from which a load at another world
  // size reshards. Before the
  // first step only the layout.
  std::vector<NamedTensor> state_shard();
  // Loads what state_shard() saved at any world size, resharding it to this
  // one. `read(k)` returns the saving run's rank k's tensors; it is called
  // only for the ranks whose chunks overlap this rank's, rank 0 always. Not
  // collective. Throws InvalidArgument, changing nothing, when the layout
  // does not fit this model and these options (another model, bucket_cap_mb
  // or optimizer), naming what differs.
  void load_state_shards(const std::function<std::vector<NamedTensor>(int rank)>& read);
  // A plain optimizer's state (LibTorch's SGD, Adam or AdamW), cut into this
  // rank's shard: as optimizer_state() saves an optimizer over this module's
  // trainable parameters in registration order, one param group (what DDP or
  // one process checkpoints), or named by parameter as
  // tp::full_optimizer_state(module, optimizer) saves one with any param
  // groups. The state is per element, so this optimizer's own param groups
  // do not matter; optimizer_state() of several groups is refused (its
  // positions do not say which parameter each is). Not collective. Throws
  // InvalidArgument, changing nothing, when it does not fit.
  void load_full_state(const std::vector<NamedTensor>& full);
  ZeroStage stage() const { return opts_.stage; }
  DistributedDataParallel& ddp() { return *ddp_; }

  struct State;  // shared with the reduce-scatter hook

 private:
  void point_grads_at_buckets(bool keep_values);
  void reduce_for_step();
  void run_all(std::vector<WorkPtr> works);
  void check_usable() const;
  std::vector<::torch::Tensor> shard_grads() const;

  std::shared_ptr<::torch::nn::Module> module_;
  std::shared_ptr<ProcessGroup> group_;
  ZeroOptions opts_;
  std::vector<::torch::Tensor> params_;  // the trainable parameters, in DDP's (registration) order
  std::unique_ptr<DistributedDataParallel> ddp_;
  std::shared_ptr<State> state_;
  std::unique_ptr<::torch::optim::Optimizer> optimizer_;
  // Per bucket: its shard parameters (runs of one param group) with their lengths, in chunk order.
  std::vector<std::vector<std::pair<::torch::Tensor, size_t>>> runs_;
  std::vector<double> lr_ratio_;        // per param group: its lr over the first group's, at construction
  // ZeRO-1: the reducer stays in no_sync (backward only accumulates).
  std::unique_ptr<ddp::NoSyncGuard> accumulate_only_;
  bool reduced_ = false;  // ZeRO-1: step()'s reduce-scatter already ran for these gradients ...
  size_t marks_at_reduce_ = 0;  // ... after this many marks of the (always no_sync) reducer
  bool stepped_ = false;  // step() ran since zero_grad()
  bool has_state_ = false;  // the shard optimizer stepped (or loaded stepped state): state_shard() saves its fields
  bool failed_ = false;   // a collective failed: the buffers it may still write into are leaked
};

// The other way round: the optimizer state a ZeroOptimizer over `module`
// saved (state_shard() of every rank of the saving run, read(k) returning
// rank k's), in optimizer_state()'s per-parameter naming, for
// load_optimizer_state into LibTorch's optimizer of the same kind over the
// module's trainable parameters (one param group): plain DDP or one process
// resuming a sharded checkpoint. Reads every rank's part. Throws
// InvalidArgument when the layout does not fit the module.
// `dtype`, when given, is the dtype the saving run's parameters had, for a
// module whose parameters now show another (an FSDP with param_dtype bf16
// over fp32 master shards): the buckets are planned in bytes.
COHORT_API std::vector<NamedTensor> zero_state_to_full(const ::torch::nn::Module& module,
                                                       const std::function<std::vector<NamedTensor>(int rank)>& read,
                                                       std::optional<::torch::ScalarType> dtype = std::nullopt);

}  // namespace cohort::torch
