// cohort/torch_fsdp.hpp: fully sharded data parallelism (FSDP, ZeRO-3) for
// LibTorch: every rank keeps 1/N of the parameters, of their gradients and of
// the optimizer state; a unit's parameters exist in full only while the unit
// computes (Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded
// Data Parallel", VLDB 2023; Rajbhandari et al., ZeRO stage 3, SC 2020).
//
// The units are the modules the model wraps in FsdpUnit (one per transformer
// block, say); the model's other parameters form the root unit, gathered for
// the whole forward and backward:
//
//   struct Net : torch::nn::Module {
//     Net() { for (int i = 0; i < 8; ++i)
//               blocks.push_back(register_module("block" + std::to_string(i),
//                                std::make_shared<cohort::torch::FsdpUnit<Block>>(Block(1024))));
//             head = register_module("head", torch::nn::Linear(1024, 10)); }   // in the root unit
//     torch::Tensor forward(torch::Tensor x) { for (auto& b : blocks) x = b->forward(x); return head(x); }
//     std::vector<std::shared_ptr<cohort::torch::FsdpUnit<Block>>> blocks;
//     torch::nn::Linear head{nullptr};
//   };
//
//   auto pg = cohort::init_process_group();
//   auto model = std::make_shared<Net>();
//   cohort::torch::FullyShardedDataParallel fsdp(model, pg);    // shards the parameters
//   torch::optim::AdamW opt(fsdp.parameters(), torch::optim::AdamWOptions(1e-3));  // over the shards
//   for (batch : loader) {
//     fsdp.zero_grad();
//     fsdp.pre_forward();                 // gathers the root unit
//     auto loss = loss_fn(model->forward(x), y);   // each unit gathered, run, freed
//     loss.backward();                    // each unit gathered again; its gradient reduce-scattered
//     fsdp.clip_grad_norm(1.0);           // optional: the global norm
//     cohort::torch::adamw_step(opt);     // or opt.step(): steps this rank's shards
//   }
//
// FsdpUnit<M> keeps M's parameter and submodule names, so the model's
// state names are those of the unwrapped model, and without an FSDP over it
// an FsdpUnit is M itself (one process, DDP). docs/fsdp.md has the design.
#pragma once

#include <torch/torch.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cohort/checkpoint.hpp"
#include "cohort/export.hpp"
#include "cohort/process_group.hpp"

namespace cohort::torch {

class FullyShardedDataParallel;
struct FsdpPreShard;

// What an FsdpUnit tells the FSDP over it (nothing when there is none).
class COHORT_API FsdpUnitBase : public ::torch::nn::Module {
 public:
  ~FsdpUnitBase() override;
  // Before the wrapped forward: the unit's parameters are gathered.
  void enter();
  // After it: they are freed; with autograd on, `out` comes back wrapped so
  // that its backward gathers them again first.
  ::torch::Tensor leave(::torch::Tensor out);
  // A floating tensor input in FsdpOptions::param_dtype when one is set;
  // anything else as it is.
  ::torch::Tensor cast_input(::torch::Tensor t) const;
  template <class A>
  A&& cast_input(A&& a) const {
    return std::forward<A>(a);
  }

 protected:
  // The end of a unit's construction: under an FsdpShardedInit, the unit is
  // sharded here (its parameters no longer held whole).
  void built();

 private:
  friend class FullyShardedDataParallel;
  FullyShardedDataParallel* fsdp_ = nullptr;
  size_t unit_ = 0;
  std::shared_ptr<FsdpPreShard> pre_;  // sharded at construction (FsdpShardedInit)
};

// Module M (a ModuleHolder such as torch::nn::Linear or a TORCH_MODULE type)
// as one FSDP unit. Its forward takes what M's does and returns its tensor,
// whose gradient is where backward gathers the unit again.
template <class M>
class FsdpUnit : public FsdpUnitBase {
 public:
  explicit FsdpUnit(M inner) : inner_(std::move(inner)) {
    // M's own parameters and children under their own names: the names of
    // the model do not change with the wrapping.
    for (auto& p : inner_->named_parameters(/*recurse=*/false)) register_parameter(p.key(), p.value(), p.value().requires_grad());
    for (auto& b : inner_->named_buffers(/*recurse=*/false)) register_buffer(b.key(), b.value());
    for (auto& c : inner_->named_children()) register_module(c.key(), c.value());
    built();
  }
  template <class... Args>
  auto forward(Args&&... args) {
    using Out = std::decay_t<decltype(inner_->forward(std::forward<Args>(args)...))>;
    static_assert(std::is_same_v<Out, ::torch::Tensor>,
                  "FsdpUnit<M>: M::forward must return one torch::Tensor (backward gathers the unit again when "
                  "the gradient reaches it); wrap a module that does, or return a tuple from outside the unit");
    enter();
    return leave(inner_->forward(cast_input(std::forward<Args>(args))...));
  }
  M& inner() { return inner_; }
  // train()/eval() reach M too: it is not a registered child (its children are).
  void train(bool on = true) override {
    ::torch::nn::Module::train(on);
    inner_->train(on);
  }

 private:
  M inner_;
};

// Sharded construction, for a model too large to be whole on one rank:
// every FsdpUnit built on this thread while one lives is sharded as soon as
// it is built (rank 0's values broadcast, this rank's chunk kept, the rest
// freed), so no rank ever holds more than one unit whole. Collective: every
// rank of `group` builds the same model inside one. The FSDP built over the
// model afterwards, on the same group, takes these shards as they are. On
// nccl each unit is sharded onto the group's GPU (build the model on the CPU,
// the default; move the rest with model->to(device) afterwards, which leaves
// the sharded units where they are: only to that device, with no dtype
// change; any other to() would copy parameters that have no data).
//
//   std::shared_ptr<Net> model;
//   { cohort::torch::FsdpShardedInit sharded(pg); model = std::make_shared<Net>(); }
//   model->to(device);  // on a GPU: the root unit's parameters
//   cohort::torch::FullyShardedDataParallel fsdp(model, pg);
class COHORT_API FsdpShardedInit {
 public:
  explicit FsdpShardedInit(std::shared_ptr<ProcessGroup> group);
  ~FsdpShardedInit();
  FsdpShardedInit(const FsdpShardedInit&) = delete;
  FsdpShardedInit& operator=(const FsdpShardedInit&) = delete;
  // The one alive on this thread (innermost), or nullptr.
  static FsdpShardedInit* current();
  ProcessGroup& group() { return *group_; }

 private:
  std::shared_ptr<ProcessGroup> group_;
  FsdpShardedInit* previous_;
};

struct COHORT_API FsdpOptions {
  // Units gathered ahead of the one that computes: the next one in forward
  // order (as the last iteration ran them) while this one's forward runs, the
  // previous one while this one's backward runs. 0 gathers each unit only
  // when it starts.
  int prefetch = 1;
  bool broadcast_buffers = true;  // rank 0's buffers in pre_forward(), as DDP's
  // Mixed precision: the units are gathered and compute in this dtype (bf16,
  // say: half the bytes to move, bf16 matmuls), while the shards the
  // optimizer steps stay in the parameters' own dtype (fp32 master weights).
  // Gradients are reduce-scattered in the master dtype. A unit's floating
  // tensor inputs are cast to it; cast the model's input yourself when the
  // root unit computes first. Unset: no casting.
  std::optional<::torch::ScalarType> param_dtype;
  // For a module on a GPU: the shards and their gradients live in host
  // memory, so parameters() are CPU tensors and the optimizer's state and
  // step are on the CPU; the GPU holds only the units being gathered. Each
  // gather copies this rank's chunk up, each reduction's chunk comes back
  // down (PyTorch FSDP's CPUOffload(offload_params=True)). Refused for a
  // module on the CPU.
  bool cpu_offload = false;
};

// What this rank holds, in elements and bytes.
struct COHORT_API FsdpMemory {
  size_t params = 0;            // trainable elements of the model
  size_t padded = 0;            // elements of every unit, each padded to a multiple of N
  size_t shard = 0;             // elements this rank keeps (padded / N)
  size_t units = 0;             // units, the root one included when it has parameters
  size_t largest_unit = 0;      // elements of the largest unit, padded
  size_t shard_bytes = 0;       // the parameter shard
  size_t grad_shard_bytes = 0;  // the gradient shard
  size_t gather_bytes = 0;      // the buffers units are gathered and reduced in (peak so far)
};

class COHORT_API FullyShardedDataParallel {
 public:
  // Collective over `group`: finds the FsdpUnit modules in `module`, checks
  // that every rank has the same units and parameters (a mismatch names the
  // parameter or unit and the ranks), broadcasts rank 0's parameters and
  // buffers, then keeps this rank's shard of each unit and frees the rest.
  // A parameter that belongs to two units (tied weights) is refused by name.
  // Frozen parameters (requires_grad false) and buffers stay whole on every
  // rank. A CPU module on a host group (native, mpi), or a module on this
  // rank's GPU on nccl (shards, gathers and gradients then live in the GPU's
  // memory and every collective is ordered after LibTorch's current stream;
  // docs/fsdp.md "On a GPU"). A GPU module on a host group is refused.
  FullyShardedDataParallel(std::shared_ptr<::torch::nn::Module> module, std::shared_ptr<ProcessGroup> group,
                           FsdpOptions opts = {});
  ~FullyShardedDataParallel();
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  // Before each forward (training or not): gathers the root unit, broadcasts
  // the buffers. A unit's forward without it throws.
  void pre_forward();
  // The shards to optimize: one 1-D tensor per unit (this rank's chunk of it,
  // padding included), whose .grad holds the averaged gradient after backward.
  std::vector<::torch::Tensor> parameters() const;
  // The same shards cut by param group, for an optimizer with param groups
  // (no weight decay for biases and norms, say): out[0] holds the parameters
  // no group names, out[g] those `groups[g - 1]` names (as the model's
  // named_parameters() names them). Each is a list of 1-D views of this
  // rank's shards: per unit, the runs of its chunk whose elements belong to
  // that group's parameters (a group may have none on this rank; padding
  // goes with the parameter before it). Build the optimizer from them:
  //   auto p = fsdp.parameter_groups({{"fc.bias", "norm.weight"}});
  //   std::vector<torch::optim::OptimizerParamGroup> g;
  //   g.emplace_back(p[0], std::make_unique<torch::optim::AdamWOptions>(AdamWOptions(3e-4).weight_decay(0.1)));
  //   g.emplace_back(p[1], std::make_unique<torch::optim::AdamWOptions>(AdamWOptions(3e-4).weight_decay(0)));
  //   torch::optim::AdamW opt(std::move(g), AdamWOptions(3e-4));
  // The optimizer state functions below take such an optimizer as they take
  // one over parameters(); its state is still saved per unit chunk, so it
  // reshards as before. Call it once. InvalidArgument for a name that is not
  // a trainable parameter or is in two groups, or an empty group.
  std::vector<std::vector<::torch::Tensor>> parameter_groups(const std::vector<std::vector<std::string>>& groups);
  // Clears the gradient shards (and what no_sync accumulated).
  void zero_grad();
  // Backward passes under it keep whole gradients in .grad instead of
  // reduce-scattering them (the next synced backward reduces the sum), as
  // DDP's no_sync: more memory, less communication.
  class [[nodiscard]] NoSync {
   public:
    explicit NoSync(FullyShardedDataParallel* f) : f_(f) {}
    NoSync(NoSync&& o) noexcept : f_(std::exchange(o.f_, nullptr)) {}
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    ~NoSync();

   private:
    FullyShardedDataParallel* f_;
  };
  NoSync no_sync();
  // Scales the gradient shards so that the global gradient's norm is at most
  // max_norm; returns the norm before clipping, the same on every rank.
  double clip_grad_norm(double max_norm);

  // The whole model's trainable parameters under their names, gathered
  // (collective; every rank gets them), with the frozen ones and the buffers:
  // what module_state() of the unwrapped model gives.
  std::vector<NamedTensor> full_state();
  // Loads such a state (from FSDP, DDP or one process): each rank keeps its
  // shard. Not collective. InvalidArgument, changing nothing, when a tensor
  // is missing or does not fit.
  void load_full_state(const std::vector<NamedTensor>& state);
  // This rank's shard of every unit ("fsdp.unit<u>", padding included) and
  // the layout ("fsdp.layout", int64: world size, unit count, then each
  // unit's elements without and with padding); on rank 0 also the frozen
  // parameters and buffers, whole ("fsdp.whole.<name>"): one file of a
  // sharded checkpoint. load_state_shards() reads it back at any world size.
  std::vector<NamedTensor> state_shard() const;
  // `read(k)` returns the saving run's rank k's state_shard(); called for
  // rank 0 (the layout) and the ranks whose chunks overlap this rank's. Not
  // collective. InvalidArgument, changing nothing, when the layout does not
  // fit this model or the saved frozen parameters and buffers are not its
  // own (files without any keep the module's).
  void load_state_shards(const std::function<std::vector<NamedTensor>(int rank)>& read);
  // The same for an optimizer over parameters() or parameter_groups() (SGD,
  // Adam or AdamW; others are refused; SGD groups either all with momentum
  // or all without): its state cut by unit ("fsdp.unit<u>.<field>", with
  // "fsdp.layout" and "fsdp.optimizer": its kind and step), and back at any
  // world size.
  std::vector<NamedTensor> optimizer_state_shard(::torch::optim::Optimizer& optimizer) const;
  void load_optimizer_state_shards(::torch::optim::Optimizer& optimizer,
                                   const std::function<std::vector<NamedTensor>(int rank)>& read);
  // A plain optimizer's state (LibTorch's SGD, Adam or AdamW), cut into this
  // rank's shards: as optimizer_state() saves an optimizer over the
  // unwrapped model's trainable parameters in registration order, one param
  // group (what DDP or one process checkpoints), or named by parameter as
  // tp::full_optimizer_state(model, optimizer) saves one with any param
  // groups. optimizer_state() of several groups is refused: its positions do
  // not say which parameter each is. Not collective. InvalidArgument,
  // changing nothing, when it does not fit.
  void load_full_optimizer_state(::torch::optim::Optimizer& optimizer, const std::vector<NamedTensor>& full);

  FsdpMemory memory() const;
  ProcessGroup& group() { return *group_; }
  // The units' names ("" for the root), in module order.
  std::vector<std::string> unit_names() const;

  struct State;  // shared with the autograd hooks

 private:
  friend class FsdpUnitBase;
  void place_on_device();
  void check_pre_sharded();
  void shard_units();
  std::shared_ptr<::torch::nn::Module> module_;
  std::shared_ptr<ProcessGroup> group_;
  FsdpOptions opts_;
  std::shared_ptr<State> state_;
};

// The other way round, for a run without FSDP (DDP, one process) resuming
// a sharded FSDP checkpoint: `module` is the same model with the same
// FsdpUnit wrapping, not wrapped in FullyShardedDataParallel, and read(k)
// returns rank k's file of the saving run (any world size). Not collective;
// every rank's part is read. InvalidArgument when the layout does not fit
// the module (another model or wrapping) or the files hold the other kind
// of state.
//   fsdp_state_to_full: the trainable parameters from state_shard()'s files,
//     under the module's names, with rank 0's saved frozen parameters and
//     buffers (the module's own for files without them), as full_state()
//     gives them: for load_module_state;
//   fsdp_optimizer_state_to_full: optimizer_state_shard()'s files in
//     optimizer_state()'s per-parameter naming, for load_optimizer_state into
//     the same kind of LibTorch optimizer over the module's trainable
//     parameters in registration order (one param group).
COHORT_API std::vector<NamedTensor> fsdp_state_to_full(const ::torch::nn::Module& module,
                                                       const std::function<std::vector<NamedTensor>(int rank)>& read);
COHORT_API std::vector<NamedTensor> fsdp_optimizer_state_to_full(
    const ::torch::nn::Module& module, const std::function<std::vector<NamedTensor>(int rank)>& read);

}  // namespace cohort::torch
