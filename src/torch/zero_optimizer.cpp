// ZeroOptimizer: ZeRO-1/2 on top of DistributedDataParallel's buckets
// (include/cohort/torch_zero.hpp has the user's view; docs/zero.md the design).
//
// DDP supplies what ZeRO shares with it: the construction checks and
// broadcasts, the autograd hooks, the bucket plan (padded here to a multiple
// of the world size N), gradients as views of the buckets, no_sync, and for
// ZeRO-2 the launch of each bucket's collective as soon as it is ready. What
// ZeRO adds:
//   - a second set of buckets, the same layout, that holds the parameters:
//     every trainable parameter becomes a view of it, so allgathering a
//     bucket in place updates the module;
//   - rank r's shard: chunk r (count / N elements) of every bucket. The
//     shard optimizer (SGD/Adam/AdamW with the fused step) has one parameter
//     per bucket and param group (the run of the chunk whose elements belong
//     to that group's parameters), a view of the parameter bucket; its
//     gradient is the same part of the gradient bucket (ZeRO-1) or of the
//     gradient shard (ZeRO-2);
//   - the reduction: ZeRO-2's comm hook reduce-scatters (Avg) each bucket
//     into the gradient shard (or in place, chunk r then added to the shard);
//     its buckets are recycled buffers (ReducerOptions::recycled_buckets), so
//     a rank never holds the whole gradient; ZeRO-1 keeps the reducer in
//     no_sync and reduce-scatters every bucket once, in step().
#include "cohort/torch_zero.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>
#include <cstring>
#include <optional>
#include <string_view>

#include <fmt/format.h>

#include "cohort/error.hpp"
#include "device.hpp"
#include "shard_state.hpp"
#include "state_key.hpp"

namespace cohort::torch {
namespace {

// The shard optimizers: LibTorch's classes (their options, state and
// checkpoint format) with the fused step, so that GradScaler::step, which
// calls optimizer.step(), takes it too.
template <class Base, void (*Fused)(Base&)>
class Shard final : public Base {
 public:
  using Base::Base;
  ::torch::Tensor step(typename Base::LossClosure) override {
    Fused(*this);
    return {};
  }
};
using ShardSgd = Shard<::torch::optim::SGD, sgd_step>;
using ShardAdam = Shard<::torch::optim::Adam, adam_step>;
using ShardAdamW = Shard<::torch::optim::AdamW, adamw_step>;

// The module's trainable parameters, in registration order (DDP's and ZeRO's order).
std::vector<::torch::Tensor> trainable_of(const ::torch::nn::Module& module) {
  std::vector<::torch::Tensor> out;
  for (const auto& p : module.parameters(true))
    if (p.requires_grad()) out.push_back(p);
  return out;
}

size_t round64(size_t bytes) { return (bytes + 63) / 64 * 64; }

double lr_of(const ShardOptimizerOptions& o) {
  return std::visit([](const auto& x) { return x.lr(); }, o);
}

// Each group's learning rate over the first's (set_lr keeps them). A first
// group at 0 (a warmup from 0) has every group at 0 (groups_of refused
// more), and they follow it: ratio 1.
std::vector<double> lr_ratios(const ShardOptimizerOptions& main, const std::vector<ZeroParamGroup>& groups) {
  const double lr = lr_of(main);
  std::vector<double> out{1.0};
  for (const ZeroParamGroup& g : groups) out.push_back(lr > 0 ? lr_of(g.options) / lr : 1.0);
  return out;
}

// The shard optimizer: group 0 steps params[0] with `main`, group g
// params[g] with groups[g - 1]'s options (validated by groups_of).
std::unique_ptr<::torch::optim::Optimizer> shard_optimizer_of(const ShardOptimizerOptions& main,
                                                              const std::vector<ZeroParamGroup>& groups,
                                                              const std::vector<std::vector<::torch::Tensor>>& params) {
  return std::visit(
      [&](const auto& o) -> std::unique_ptr<::torch::optim::Optimizer> {
        using O = std::decay_t<decltype(o)>;
        std::vector<::torch::optim::OptimizerParamGroup> all;
        all.emplace_back(params.at(0), std::make_unique<O>(o));
        for (size_t g = 0; g < groups.size(); ++g)
          all.emplace_back(params.at(g + 1), std::make_unique<O>(std::get<O>(groups[g].options)));
        if constexpr (std::is_same_v<O, ::torch::optim::SGDOptions>)
          return std::make_unique<ShardSgd>(std::move(all), o);
        else if constexpr (std::is_same_v<O, ::torch::optim::AdamOptions>)
          return std::make_unique<ShardAdam>(std::move(all), o);
        else
          return std::make_unique<ShardAdamW>(std::move(all), o);
      },
      main);
}

// Each trainable parameter's param group (0: the constructor's options; g:
// opts.param_groups[g - 1]), by registration index; InvalidArgument naming
// what does not fit. (ShardOptimizerOptions' alternatives are in the order
// of shard::kKindNames.)
std::vector<size_t> groups_of(const ::torch::nn::Module& module, const ShardOptimizerOptions& main,
                              const std::vector<ZeroParamGroup>& groups) {
  const char* const* kinds = shard::kKindNames;
  std::vector<std::string> names;
  std::map<std::string, size_t> index_by_name;
  for (const auto& item : module.named_parameters(true))
    if (item.value().requires_grad()) {
      index_by_name.emplace(item.key(), names.size());
      names.push_back(item.key());
    }
  std::vector<std::vector<std::string>> named;
  for (size_t g = 0; g < groups.size(); ++g) {
    const ZeroParamGroup& group = groups[g];
    const std::string which = fmt::format("ZeroOptimizer: param group {}", g + 1);
    if (group.options.index() != main.index())
      throw InvalidArgument(fmt::format("{} is {}, the optimizer is {}: one optimizer steps every group. HINT: give "
                                        "the group {} options",
                                        which, kinds[group.options.index()], kinds[main.index()], kinds[main.index()]));
    const double lr = lr_of(group.options);
    if (!(lr >= 0) || !std::isfinite(lr))
      throw InvalidArgument(fmt::format("{}: the learning rate must be a finite number >= 0 (got {})", which, lr));
    if (lr > 0 && lr_of(main) == 0)
      throw InvalidArgument(fmt::format("{} has learning rate {} and the optimizer 0: set_lr() keeps each group's "
                                        "ratio to the first group's learning rate, which 0 does not define. HINT: "
                                        "construct with the schedule's peak learning rates and call set_lr() before "
                                        "the first step",
                                        which, lr));
    named.push_back(group.names);
  }
  return shard::assign_groups(index_by_name, names, names.size(), named, "ZeroOptimizer: ", "param group");
}


}  // namespace

struct COHORT_HIDDEN ZeroOptimizer::State {
  struct Bucket {
    std::byte* grad = nullptr;        // ZeRO-1: the reducer's bucket
    std::byte* param = nullptr;       // the same layout in the parameter storage
    std::byte* grad_shard = nullptr;  // ZeRO-2: this rank's reduced chunk, accumulated
    size_t count = 0;                 // elements, padding included (a multiple of n)
    size_t used = 0;                  // elements of parameters (count less the padding)
    size_t chunk = 0;                 // count / n
    DType dtype = DType::F32;
    ::torch::ScalarType type = ::torch::kFloat;
    bool fresh = true;                // ZeRO-2: the next reduced chunk replaces the shard's contents
  };
  int rank = 0, n = 1;
  // Where the module is, and so the parameter buckets, the gradients and
  // the shard optimizer's state: the CPU (Host) or the group's GPU (Device,
  // on nccl; every copy and zeroing a LibTorch operation on its current
  // stream, every collective ordered after that stream).
  ::torch::Device device{::torch::kCPU};
  MemoryMode mode = MemoryMode::Host;
  std::vector<Bucket> buckets;
  std::shared_ptr<std::byte[]> params;      // also owned by every parameter's storage
  std::shared_ptr<std::byte[]> grad_shard;  // ZeRO-2
  std::atomic<bool> synced{false};      // ZeRO-2: a bucket was reduced since zero_grad() ...
  std::atomic<bool> after_step{false};  // ... or since the last step()
  // Every collective issued on these buffers (the hook's, step()'s), so that
  // none is left writing into them when they are freed.
  std::mutex works_mu;
  std::vector<WorkPtr> works;
  void issued(WorkPtr w) {
    std::lock_guard<std::mutex> g(works_mu);
    std::erase_if(works, [](const WorkPtr& x) { return x->is_completed(); });
    works.push_back(std::move(w));
  }
  bool any_running() {
    std::lock_guard<std::mutex> g(works_mu);
    return std::any_of(works.begin(), works.end(), [](const WorkPtr& x) { return !x->is_completed(); });
  }

  Buffer mine(std::byte* bucket_data, const Bucket& b) const {
    return Buffer{bucket_data + static_cast<size_t>(rank) * b.chunk * dtype_size(b.dtype), b.chunk, b.dtype};
  }
  // `count` elements of bucket b's type at `data`, on the module's device.
  ::torch::Tensor tensor(void* data, size_t count, const Bucket& b) const {
    return wrap(data, {static_cast<int64_t>(count)}, ::torch::TensorOptions().dtype(b.type).device(device));
  }
  void zero(std::byte* data, size_t count, const Bucket& b) const {
    zero_own_bytes(data, count * dtype_size(b.dtype), mode, device);
  }
  // The stream collectives issued now are ordered after (CudaStreamScope):
  // LibTorch's current one on a GPU, none on the CPU.
  void* stream() const { return current_stream_handle(device); }

  // ZeRO-2, in finalize() (or when the reducer needs the bucket's buffer):
  // bucket b's reduced chunk into the shard (the first reduction since
  // zero_grad() was written there directly).
  void take(size_t b, const Buffer& reduced) {
    Bucket& k = buckets[b];
    if (reduced.data == k.grad_shard) {
      k.fresh = false;
    } else {
      ::torch::NoGradGuard no_grad;
      tensor(k.grad_shard, k.chunk, k).add_(tensor(reduced.data, k.chunk, k));
    }
    synced = true;
    after_step = true;
  }
};

namespace {
// Every bucket of parameters, in place: rank r's chunk to every rank (started, not waited for).
std::vector<WorkPtr> allgather_params(ProcessGroup& group, const ZeroOptimizer::State& st) {
  std::vector<WorkPtr> works;
  for (const auto& k : st.buckets)
    if (k.count > 0) works.push_back(group.allgather(st.mine(k.param, k), Buffer{k.param, k.count, k.dtype}));
  return works;
}

// The constructor's refusals, before anything moves (DistributedDataParallel's
// constructor checks the devices further: one device, the group's GPU).
void check_arguments(const std::shared_ptr<::torch::nn::Module>& module, const std::shared_ptr<ProcessGroup>& group,
                     const ShardOptimizerOptions& optimizer, const ZeroOptions& opts) {
  if (!module) throw InvalidArgument("ZeroOptimizer: the module is null");
  if (!group) throw InvalidArgument("ZeroOptimizer: the process group is null (call cohort::init_process_group())");
  if (opts.stage != ZeroStage::One && opts.stage != ZeroStage::Two)
    throw InvalidArgument(fmt::format("ZeroOptimizer: stage {} does not exist; use ZeroStage::One or ZeroStage::Two "
                                      "(parameter sharding, ZeRO-3, is FSDP)",
                                      static_cast<int>(opts.stage)));
  if (opts.stage == ZeroStage::One && opts.find_unused_parameters)
    throw InvalidArgument("ZeroOptimizer: find_unused_parameters is for ZeRO-2; ZeRO-1 reduces in step(), after "
                          "backward, where a parameter without a gradient simply counts as zeros. HINT: leave it off");
  if (opts.stage == ZeroStage::Two && opts.grad_buffers == 0)
    throw InvalidArgument("ZeroOptimizer: grad_buffers is 0; ZeRO-2 needs at least one bucket buffer to reduce "
                          "gradients through. HINT: leave it at 2 (one bucket filling while one is reduced)");
  const double lr = lr_of(optimizer);
  if (!(lr >= 0) || !std::isfinite(lr))
    throw InvalidArgument(fmt::format("ZeroOptimizer: the learning rate must be a finite number >= 0 (got {})", lr));
  if (group->cuda_device() < 0)
    for (auto& item : module->named_parameters(true))
      if (item.value().device().is_cuda())
        throw InvalidArgument(fmt::format(
            "ZeroOptimizer: parameter '{}' is on {}, but the {} backend reduces host memory; ZeRO keeps its buckets "
            "where the module is and shards them with the group's own collectives, so a GPU module needs the nccl "
            "backend (docs/zero.md). HINT: COHORT_BACKEND=nccl, one process per GPU; or keep the module on the CPU",
            item.key(), item.value().device().str(), group->backend_name()));
}
}  // namespace

ZeroOptimizer::ZeroOptimizer(std::shared_ptr<::torch::nn::Module> module, std::shared_ptr<ProcessGroup> group,
                             ShardOptimizerOptions optimizer, ZeroOptions opts)
    : module_(std::move(module)), group_(std::move(group)), opts_(opts), state_(std::make_shared<State>()) {
  check_arguments(module_, group_, optimizer, opts_);
  const std::vector<size_t> group_of = groups_of(*module_, optimizer, opts_.param_groups);

  State& st = *state_;
  st.rank = group_->rank();
  st.n = group_->size();
  DistributedDataParallelOptions d;
  d.bucket_cap_mb = opts_.bucket_cap_mb;
  d.first_bucket_mb = opts_.first_bucket_mb;
  d.find_unused_parameters = opts_.find_unused_parameters;
  d.gradient_as_bucket_view = opts_.stage == ZeroStage::One;  // ZeRO-2: .grad is freed once in a bucket
  d.recycled_buckets = opts_.stage == ZeroStage::Two ? opts_.grad_buffers : 0;
  d.broadcast_buffers = opts_.broadcast_buffers;
  d.reduce_at_world_size_1 = true;  // one code path at every world size
  d.bucket_count_multiple = static_cast<size_t>(st.n);
  if (opts_.stage == ZeroStage::Two) {
    d.comm_hook = [s = state_](ddp::GradBucket& bucket) -> ddp::CommFuture {
      const Buffer all = bucket.buffer();
      if (all.count == 0) return {};
      const State::Bucket& k = s->buckets[bucket.index()];
      // The first reduction since zero_grad() lands in the gradient shard
      // itself; a later one (synced micro-batches) in place, added in take().
      const Buffer into = k.fresh ? Buffer{k.grad_shard, k.chunk, k.dtype} : s->mine(static_cast<std::byte*>(all.data), k);
      WorkPtr work = bucket.group().reduce_scatter(all, into, {.op = ReduceOp::Avg, .timeout = bucket.timeout()});
      s->issued(work);
      return {std::move(work), [s, b = bucket.index(), into] { s->take(b, into); }};
    };
  }
  ddp_ = std::make_unique<DistributedDataParallel>(module_, group_, d);  // checks, broadcasts, hooks
  if (opts_.stage == ZeroStage::One) accumulate_only_ = std::make_unique<ddp::NoSyncGuard>(ddp_->reducer());

  // The parameter storage: the reducer's bucket layout, one allocation.
  ddp::Reducer& reducer = ddp_->reducer();
  const ddp::BucketPlan& plan = reducer.plan();
  size_t total = 0, shard_total = 0;
  std::vector<size_t> at(plan.size()), shard_at(plan.size());
  for (size_t b = 0; b < plan.size(); ++b) {
    at[b] = total;
    total += round64(plan[b].bytes());
    shard_at[b] = shard_total;
    shard_total += round64(plan[b].bytes() / static_cast<size_t>(st.n));
  }
  st.device = ddp_->device();
  st.mode = memory_mode(st.device, *group_);
  st.params = own_bytes(*group_, st.mode, st.device, total, true);
  if (opts_.stage == ZeroStage::Two) st.grad_shard = own_bytes(*group_, st.mode, st.device, shard_total, false);
  params_ = trainable_of(*module_);  // DDP's order: reducer parameter i is params_[i]

  ::torch::NoGradGuard no_grad;
  const auto on_device = [&st](::torch::ScalarType t) { return ::torch::TensorOptions().dtype(t).device(st.device); };
  st.buckets.resize(plan.size());
  runs_.resize(plan.size());
  std::vector<std::vector<::torch::Tensor>> group_params(opts_.param_groups.size() + 1);
  std::vector<size_t> sizes;  // by parameter
  for (const auto& p : params_) sizes.push_back(static_cast<size_t>(p.numel()));
  for (size_t b = 0; b < plan.size(); ++b) {
    State::Bucket& k = st.buckets[b];
    if (opts_.stage == ZeroStage::One) k.grad = static_cast<std::byte*>(reducer.bucket_data(b));
    k.param = st.params.get() + at[b];
    k.count = plan[b].count;
    k.chunk = k.count / static_cast<size_t>(st.n);
    k.dtype = plan[b].dtype;
    if (st.grad_shard) k.grad_shard = st.grad_shard.get() + shard_at[b];
    for (size_t j = 0; j < plan[b].params.size(); ++j) {
      ::torch::Tensor& p = params_.at(plan[b].params[j]);
      k.type = p.scalar_type();
      k.used += static_cast<size_t>(p.numel());
      std::byte* slot = k.param + plan[b].offsets[j] * dtype_size(k.dtype);
      auto moved = wrap(slot, p.sizes(), on_device(p.scalar_type()), st.params);
      moved.copy_(p);
      p.set_data(moved);  // the module's parameter now lives in the bucket
    }
    if (k.chunk == 0) continue;
    // One shard parameter per run of one param group in this rank's chunk
    // (the whole chunk when every parameter is in the first group).
    const size_t elem = dtype_size(k.dtype);
    std::byte* param_chunk = static_cast<std::byte*>(st.mine(k.param, k).data);
    std::byte* grad_chunk = opts_.stage == ZeroStage::Two ? k.grad_shard : static_cast<std::byte*>(st.mine(k.grad, k).data);
    const auto& grad_owner = opts_.stage == ZeroStage::Two ? st.grad_shard : nullptr;  // ZeRO-1: the reducer's bucket
    for (const shard::RunSpan& r :
         shard::runs_of(plan[b].params, plan[b].offsets, sizes, group_of, k.count, k.chunk, st.rank)) {
      const int64_t n = static_cast<int64_t>(r.len);
      auto sp = wrap(param_chunk + r.start * elem, {n}, on_device(k.type), st.params);
      sp.requires_grad_(true);
      sp.mutable_grad() = wrap(grad_chunk + r.start * elem, {n}, on_device(k.type), grad_owner);
      runs_[b].emplace_back(sp, r.len);
      group_params[r.group].push_back(sp);
    }
  }
  if (std::all_of(runs_.begin(), runs_.end(), [](const auto& r) { return r.empty(); }))
    throw InvalidArgument("ZeroOptimizer: the module has no trainable parameter with elements: nothing to shard");
  // Param group g steps its runs with its options (an empty group on a rank
  // whose chunks hold none of its parameters is kept, so that g is g everywhere).
  lr_ratio_ = lr_ratios(optimizer, opts_.param_groups);
  optimizer_ = shard_optimizer_of(optimizer, opts_.param_groups, group_params);
}

ZeroOptimizer::~ZeroOptimizer() {
  if (failed_ || state_->any_running()) {
    // A collective may still write into the buckets, the gradient shard or
    // the parameters (after a failed step or backward): never free them
    // under it. Leaked, as the reducer leaks its own buckets then.
    (void)new std::shared_ptr<State>(state_);
    (void)accumulate_only_.release();
    (void)ddp_.release();
    return;
  }
  accumulate_only_.reset();
  optimizer_.reset();
  ddp_.reset();  // ZeRO-1 leaves .grad as copies of the buckets
}

void ZeroOptimizer::check_usable() const {
  if (failed_)
    throw Error("ZeroOptimizer: a collective of an earlier step failed, so the ranks no longer agree on the "
                "parameters; this optimizer can no longer be used (restart from a checkpoint)");
}

// Waits for every collective in `works`; if one fails, the others may still
// run, so the buffers are kept for good (the destructor leaks them).
void ZeroOptimizer::run_all(std::vector<WorkPtr> works) {
  for (const auto& w : works) state_->issued(w);
  try {
    for (const auto& w : works) w->wait();
  } catch (...) {
    failed_ = true;
    throw;
  }
}

void ZeroOptimizer::pre_forward() {
  check_usable();
  ddp_->pre_forward();
}

ddp::NoSyncGuard ZeroOptimizer::no_sync() {
  check_usable();
  return ddp_->no_sync();
}

void ZeroOptimizer::zero_grad() {
  check_usable();
  State& st = *state_;
  for (auto& k : st.buckets) k.fresh = true;
  st.synced = false;
  st.after_step = false;
  reduced_ = false;
  stepped_ = false;
  if (opts_.stage == ZeroStage::Two) {
    // A synced backward freed every .grad; only no_sync accumulation is left there.
    for (auto& p : params_) p.mutable_grad().reset();
    return;
  }
  // ZeRO-1 accumulates in the buckets always.
  for (auto& k : st.buckets) st.zero(k.grad, k.count, k);
  point_grads_at_buckets(false);  // .grad set to none by the user: back to the bucket views (zeros)
}

// .grad of every parameter as a view of its bucket slot again. keep_values:
// a gradient backward made fresh (after the user set .grad to none) is
// copied in, a missing one counts as zeros; otherwise the slots stay as they
// are (zero_grad cleared them).
void ZeroOptimizer::point_grads_at_buckets(bool keep_values) {
  ::torch::NoGradGuard no_grad;
  ddp::Reducer& reducer = ddp_->reducer();
  for (size_t i = 0; i < params_.size(); ++i) {
    ::torch::Tensor& p = params_[i];
    void* slot = reducer.bucket_slot(i);
    auto& g = p.mutable_grad();
    if (p.numel() > 0 && (!g.defined() || g.data_ptr() != slot)) {
      auto view = wrap(slot, p.sizes(), p.options());
      if (keep_values && g.defined()) view.copy_(g);
      else if (keep_values) view.zero_();
      g = view;
      reducer.set_grad(i, slot);
    }
  }
}

void ZeroOptimizer::reduce_for_step() {
  check_usable();
  State& st = *state_;
  const size_t marks = ddp_->reducer().no_sync_marks();
  constexpr const char* kAfterReduce =
      "ZeroOptimizer: a backward ran after this step's gradients were reduced (by clip_grad_norm, unscale or step) and "
      "before zero_grad(); its gradients would be lost or counted twice. HINT: call opt.zero_grad() (not the module's) "
      "before the first backward of each step";
  if (opts_.stage == ZeroStage::Two) {
    if (marks > 0)
      throw InvalidArgument("ZeroOptimizer: the last backward ran under no_sync(), so its gradients were never "
                            "reduced; HINT: run the last micro-batch's backward outside no_sync()");
    if (stepped_ && st.after_step.load()) throw InvalidArgument(kAfterReduce);
    for (auto& k : st.buckets)  // a bucket no backward reduced (no gradients at all): zeros
      if (k.fresh) st.zero(k.grad_shard, k.chunk, k);
    return;
  }
  // ZeRO-1: the reducer stays in no_sync, so its marks count every backward.
  if (reduced_) {
    if (marks != marks_at_reduce_) throw InvalidArgument(kAfterReduce);
    return;
  }
  point_grads_at_buckets(true);
  CudaStreamScope scope(st.stream());  // after the gradients' accumulation
  std::vector<WorkPtr> works;
  for (auto& k : st.buckets)
    if (k.count > 0)
      works.push_back(group_->reduce_scatter(Buffer{k.grad, k.count, k.dtype}, st.mine(k.grad, k), {.op = ReduceOp::Avg}));
  run_all(std::move(works));
  reduced_ = true;
  marks_at_reduce_ = marks;
}

std::vector<::torch::Tensor> ZeroOptimizer::shard_grads() const {
  std::vector<::torch::Tensor> out;
  for (auto& group : optimizer_->param_groups())
    for (auto& p : group.params()) out.push_back(p.grad());
  return out;
}

double ZeroOptimizer::clip_grad_norm(double max_norm) {
  check_usable();
  if (!(max_norm > 0) || !std::isfinite(max_norm))
    throw InvalidArgument(fmt::format("ZeroOptimizer::clip_grad_norm: max_norm must be a finite number > 0 (got {})",
                                      max_norm));
  reduce_for_step();
  ::torch::NoGradGuard no_grad;
  ::torch::Tensor squares;  // on the shard's device, read back once (a GPU syncs once per call)
  for (auto& g : shard_grads()) {
    ::torch::Tensor s = g.to(::torch::kDouble).square().sum();
    squares = squares.defined() ? squares.add_(s) : s;
  }
  const double local = squares.defined() ? squares.item<double>() : 0.0;
  const double norm = std::sqrt(allreduce_scalar(*group_, local, ReduceOp::Sum));
  const double coef = max_norm / (norm + 1e-6);  // as torch.nn.utils.clip_grad_norm_
  if (coef < 1)
    for (auto& g : shard_grads()) g.mul_(coef);
  return norm;
}

bool ZeroOptimizer::unscale(GradScaler& scaler) {
  reduce_for_step();
  return scaler.unscale(*optimizer_, group_.get());
}

void ZeroOptimizer::step() {
  reduce_for_step();
  optimizer_->step();
  has_state_ = true;
  CudaStreamScope scope(state_->stream());  // after the step's kernels
  run_all(allgather_params(*group_, *state_));
  stepped_ = true;
  state_->after_step = false;
}

bool ZeroOptimizer::step(GradScaler& scaler) {
  reduce_for_step();
  const bool stepped = scaler.step(*optimizer_, group_.get());  // the same decision on every rank
  has_state_ = has_state_ || stepped;
  if (stepped) {
    CudaStreamScope scope(state_->stream());
    run_all(allgather_params(*group_, *state_));
  }
  stepped_ = true;
  state_->after_step = false;
  return stepped;
}

double ZeroOptimizer::lr() const { return optimizer_->param_groups().at(0).options().get_lr(); }
void ZeroOptimizer::set_lr(double lr) {
  if (!(lr >= 0) || !std::isfinite(lr))
    throw InvalidArgument(fmt::format("ZeroOptimizer::set_lr: the learning rate must be a finite number >= 0 (got {})", lr));
  auto& groups = optimizer_->param_groups();
  for (size_t g = 0; g < groups.size(); ++g) groups[g].options().set_lr(lr * lr_ratio_.at(g));
}

::torch::optim::Optimizer& ZeroOptimizer::shard_optimizer() { return *optimizer_; }

ZeroMemory ZeroOptimizer::memory() const {
  ZeroMemory m;
  for (const auto& p : params_) m.params += static_cast<size_t>(p.numel());
  for (const auto& k : state_->buckets) {
    m.padded += k.count;
    m.shard += k.chunk;
    m.param_bytes += k.count * dtype_size(k.dtype);
    if (k.grad_shard) m.grad_shard_bytes += k.chunk * dtype_size(k.dtype);
  }
  // ZeRO-1: the reducer's buckets, a full replica; ZeRO-2: the pool of
  // bucket buffers its backward has needed so far.
  m.grad_bytes = ddp_->reducer().bucket_memory_bytes();
  m.optimizer_state_bytes = optimizer_state_bytes(*optimizer_);
  return m;
}

// ---- Sharded optimizer state ----

using namespace shard;  // NOLINT: the helpers ZeRO and FSDP share

namespace {

// "zero.layout": int64 [world, kind, steps, buckets, cap bytes, first cap
// bytes, then per bucket: elements without padding, with padding].
struct Layout {
  int world = 1;
  Kind kind = kSgd;
  int64_t steps = 0;
  size_t cap_bytes = 0, first_cap_bytes = 0;
  std::vector<std::pair<size_t, size_t>> buckets;  // (used, count)

  std::vector<int64_t> encode() const {
    std::vector<int64_t> v{world, kind, steps, static_cast<int64_t>(buckets.size()), static_cast<int64_t>(cap_bytes),
                           static_cast<int64_t>(first_cap_bytes)};
    for (const auto& [used, count] : buckets) {
      v.push_back(static_cast<int64_t>(used));
      v.push_back(static_cast<int64_t>(count));
    }
    return v;
  }
  static Layout decode(const std::map<std::string, const NamedTensor*>& rank0, const char* who) {
    const auto it = rank0.find("zero.layout");
    if (it == rank0.end() || it->second->dtype != DType::I64)
      throw InvalidArgument(fmt::format("{}: rank 0's shard has no int64 \"zero.layout\": it was not written by "
                                        "ZeroOptimizer::state_shard()",
                                        who));
    std::vector<int64_t> v(it->second->numel());
    std::memcpy(v.data(), it->second->bytes.data(), v.size() * sizeof(int64_t));
    if (v.size() < 6 || v[0] < 1 || v[1] < 0 || v[1] > 2 || v[3] < 0 || static_cast<size_t>(v[3]) * 2 + 6 != v.size())
      throw InvalidArgument(fmt::format("{}: \"zero.layout\" is malformed ({} values)", who, v.size()));
    Layout l{.world = static_cast<int>(v[0]), .kind = static_cast<Kind>(v[1]), .steps = v[2],
             .cap_bytes = static_cast<size_t>(v[4]), .first_cap_bytes = static_cast<size_t>(v[5]), .buckets = {}};
    for (size_t b = 0; b < static_cast<size_t>(v[3]); ++b) {
      const size_t used = static_cast<size_t>(v[6 + 2 * b]), count = static_cast<size_t>(v[7 + 2 * b]);
      if (count % static_cast<size_t>(l.world) != 0 || used > count)
        throw InvalidArgument(fmt::format("{}: \"zero.layout\" bucket {} has {} elements of {} padded, not a "
                                          "multiple of the world size {}",
                                          who, b, used, count, l.world));
      l.buckets.emplace_back(used, count);
    }
    return l;
  }
};

// As the reducer turns bucket_cap_mb into bytes (reducer.cpp), so that a plan rebuilt from them is its plan.
size_t mib_bytes(double mib) { return static_cast<size_t>(mib * 1024 * 1024); }

}  // namespace

std::vector<NamedTensor> ZeroOptimizer::state_shard() {
  const State& st = *state_;
  std::vector<NamedTensor> out;
  Layout layout{.world = st.n, .kind = kind_of(*optimizer_), .steps = 0, .cap_bytes = mib_bytes(opts_.bucket_cap_mb),
                .first_cap_bytes = mib_bytes(opts_.first_bucket_mb), .buckets = {}};
  const std::vector<std::string> fields = saved_fields(*optimizer_, has_state_);
  for (size_t b = 0; b < st.buckets.size(); ++b) {
    const State::Bucket& k = st.buckets[b];
    layout.buckets.emplace_back(k.used, k.count);
    if (k.chunk == 0) continue;
    const ShardState s = chunk_state(*optimizer_, runs_[b], fields, k.type, st.device);
    layout.steps = std::max(layout.steps, s.step);
    for (const auto& [field, t] : s.fields) out.push_back(to_named(fmt::format("bucket{}.{}", b, field), t));
  }
  const std::vector<int64_t> v = layout.encode();
  out.push_back(make_tensor("zero.layout", {static_cast<int64_t>(v.size())}, v));
  return out;
}

void ZeroOptimizer::load_state_shards(const std::function<std::vector<NamedTensor>(int rank)>& read) {
  const State& st = *state_;
  constexpr const char* kWho = "ZeroOptimizer::load_state_shards";
  ShardFiles files(read);
  const auto& first = files.get(0);
  const Layout lay = Layout::decode(first, kWho);
  const int old_n = lay.world;
  const Kind kind = kind_of(*optimizer_);
  if (lay.kind != kind)
    throw InvalidArgument(fmt::format("{}: the checkpoint holds {} state, this optimizer is {}; HINT: resume with the "
                                      "optimizer it was written with",
                                      kWho, kKindNames[lay.kind], kKindNames[kind]));
  if (lay.buckets.size() != st.buckets.size())
    throw InvalidArgument(fmt::format("{}: the checkpoint's shard layout has {} buckets, this model has {}: another "
                                      "model or another bucket_cap_mb / first_bucket_mb; HINT: resume with the same "
                                      "model and bucket sizes",
                                      kWho, lay.buckets.size(), st.buckets.size()));
  for (size_t b = 0; b < st.buckets.size(); ++b)
    if (lay.buckets[b].first != st.buckets[b].used)
      throw InvalidArgument(fmt::format("{}: bucket {} holds {} elements in the checkpoint and {} in this model: another "
                                        "model or another bucket_cap_mb / first_bucket_mb; HINT: resume with the same "
                                        "model and bucket sizes",
                                        kWho, b, lay.buckets[b].first, st.buckets[b].used));

  // Every new tensor is built before any is installed: a failure changes nothing.
  std::vector<std::pair<::torch::Tensor, ShardState>> staged;
  for (size_t b = 0; b < st.buckets.size(); ++b) {
    const State::Bucket& k = st.buckets[b];
    if (k.chunk == 0) continue;
    const int64_t old_chunk = static_cast<int64_t>(lay.buckets[b].second) / old_n;
    ShardState s{.fields = {}, .step = lay.steps};
    const std::string prefix = fmt::format("bucket{}.", b);
    for (const auto& [name, t] : first) {
      if (name.rfind(prefix, 0) != 0) continue;
      const std::string field = name.substr(prefix.size());
      s.fields.emplace_back(field, files.rechunk(name, k.type, st.rank, k.chunk, k.used, old_chunk, kWho).to(st.device));
    }
    // The chunk's state cut at its runs (param groups).
    std::vector<ShardState> parts = split_state(s, runs_[b]);
    for (size_t i = 0; i < parts.size(); ++i) staged.emplace_back(runs_[b][i].first, std::move(parts[i]));
  }
  for (auto& [p, s] : staged) {
    install_state(*optimizer_, p, kind, s);
  }
  // Whether the saving run had stepped: its files name state fields (the same on every rank).
  has_state_ = std::any_of(first.begin(), first.end(), [](const auto& t) { return t.first.rfind("bucket", 0) == 0; });
}

void ZeroOptimizer::load_full_state(const std::vector<NamedTensor>& full) {
  constexpr const char* kWho = "ZeroOptimizer::load_full_state";
  const State& st = *state_;
  const ddp::BucketPlan& plan = ddp_->reducer().plan();
  const std::vector<::torch::Tensor>& params = params_;
  const Kind kind = kind_of(*optimizer_);
  // By position (one group), or by parameter name (any groups: tp::full_optimizer_state).
  const std::vector<NamedTensor> positional = plain_state_by_position(full, trainable_places(*module_), kWho);
  const PlainState plain = parse_plain_state(positional, params.size(), kind, kWho);
  const auto& by_param = plain.by_param;
  const int64_t steps = plain.steps;
  // One shard of a world of 1 (no padding), which load_state_shards cuts to this world.
  Layout layout{.world = 1, .kind = kind, .steps = steps, .cap_bytes = mib_bytes(opts_.bucket_cap_mb),
                .first_cap_bytes = mib_bytes(opts_.first_bucket_mb), .buckets = {}};
  std::vector<NamedTensor> shard;
  for (size_t b = 0; b < plan.size(); ++b) {
    const State::Bucket& k = st.buckets[b];
    layout.buckets.emplace_back(k.used, k.used);
    std::map<std::string, ::torch::Tensor> fields;
    for (size_t j = 0; j < plan[b].params.size(); ++j) {
      const size_t i = plan[b].params[j];
      const auto found = by_param.find(i);
      if (found == by_param.end()) continue;  // not stepped yet: zeros
      for (const auto& [field, t] : found->second) {
        auto& flat = fields[field];
        if (!flat.defined()) flat = ::torch::zeros({static_cast<int64_t>(k.used)}, ::torch::TensorOptions().dtype(k.type));
        const ::torch::Tensor v = from_named(*t);
        if (v.numel() != params[i].numel() || v.scalar_type() != k.type)
          throw InvalidArgument(fmt::format("{}: \"{}\" has {} elements of {}, its parameter {} of {}: another model",
                                            kWho, t->name, v.numel(), c10::toString(v.scalar_type()),
                                            params[i].numel(), c10::toString(k.type)));
        flat.narrow(0, static_cast<int64_t>(plan[b].offsets[j]), v.numel()).copy_(v.reshape({-1}));
      }
    }
    for (const auto& [field, flat] : fields) shard.push_back(to_named(fmt::format("bucket{}.{}", b, field), flat));
  }
  const std::vector<int64_t> v = layout.encode();
  shard.push_back(make_tensor("zero.layout", {static_cast<int64_t>(v.size())}, v));
  load_state_shards([&](int) { return shard; });
}

std::vector<NamedTensor> zero_state_to_full(const ::torch::nn::Module& module,
                                            const std::function<std::vector<NamedTensor>(int rank)>& read,
                                            std::optional<::torch::ScalarType> dtype) {
  constexpr const char* kWho = "zero_state_to_full";
  ShardFiles files(read);
  const auto& first = files.get(0);
  const Layout lay = Layout::decode(first, kWho);
  const std::vector<::torch::Tensor> params = trainable_of(module);
  std::vector<ddp::ParamSpec> specs;
  for (const auto& p : params) specs.push_back({"", static_cast<size_t>(p.numel()), to_dtype(dtype.value_or(p.scalar_type()))});
  const ddp::BucketPlan plan = ddp::plan_buckets(
      specs, {.cap_bytes = lay.cap_bytes, .first_cap_bytes = lay.first_cap_bytes, .count_multiple = static_cast<size_t>(lay.world)});
  if (plan.size() != lay.buckets.size())
    throw InvalidArgument(fmt::format("{}: the shards hold {} buckets, this module's parameters make {}: another model",
                                      kWho, lay.buckets.size(), plan.size()));
  std::vector<NamedTensor> out;
  std::vector<bool> stepped(params.size(), false);
  for (size_t b = 0; b < plan.size(); ++b) {
    if (plan[b].count != lay.buckets[b].second)
      throw InvalidArgument(fmt::format("{}: bucket {} holds {} elements in the shards, {} for this module: another model",
                                        kWho, b, lay.buckets[b].second, plan[b].count));
    const int64_t chunk = static_cast<int64_t>(plan[b].count) / lay.world;
    const std::string prefix = fmt::format("bucket{}.", b);
    for (const auto& [name, t] : first) {
      if (name.rfind(prefix, 0) != 0 || chunk == 0) continue;
      const ::torch::ScalarType type = from_named(*t).scalar_type();
      const ::torch::Tensor whole = files.whole(name, lay.world, chunk, type, kWho);
      for (size_t j = 0; j < plan[b].params.size(); ++j) {
        const size_t i = plan[b].params[j];
        const auto v = whole.narrow(0, static_cast<int64_t>(plan[b].offsets[j]), params[i].numel()).view(params[i].sizes());
        out.push_back(to_named(fmt::format("group0.param{}.{}", i, name.substr(prefix.size())), v));
        stepped[i] = true;
      }
    }
  }
  if (lay.kind != kSgd)
    for (size_t i = 0; i < params.size(); ++i)
      if (stepped[i]) out.push_back(to_named(fmt::format("group0.param{}.step", i), ::torch::tensor(lay.steps, ::torch::kLong)));
  return out;
}

}  // namespace cohort::torch
