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
//     per bucket, a view of that chunk of the parameter bucket; its gradient
//     is the same chunk of the gradient bucket (ZeRO-1) or of the gradient
//     shard (ZeRO-2);
//   - the reduction: ZeRO-2's comm hook reduce-scatters (Avg) the bucket in
//     place, adds chunk r to the gradient shard in finalize() and clears the
//     bucket for the next backward; ZeRO-1 keeps the reducer in no_sync and
//     reduce-scatters every bucket once, in step().
#include "cohort/torch_zero.hpp"

#include <atomic>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "cohort/error.hpp"

namespace cohort::torch {
namespace {

// The shard optimizers: LibTorch's classes (their options, state and
// checkpoint format) with the fused step, so that GradScaler::step, which
// calls optimizer.step(), takes it too.
class ShardSgd final : public ::torch::optim::SGD {
 public:
  using SGD::SGD;
  ::torch::Tensor step(LossClosure) override {
    sgd_step(*this);
    return {};
  }
};
class ShardAdam final : public ::torch::optim::Adam {
 public:
  using Adam::Adam;
  ::torch::Tensor step(LossClosure) override {
    adam_step(*this);
    return {};
  }
};
class ShardAdamW final : public ::torch::optim::AdamW {
 public:
  using AdamW::AdamW;
  ::torch::Tensor step(LossClosure) override {
    adamw_step(*this);
    return {};
  }
};

size_t round64(size_t bytes) { return (bytes + 63) / 64 * 64; }

// A tensor over `data` that keeps `owner` alive.
::torch::Tensor view_of(void* data, ::torch::IntArrayRef sizes, ::torch::ScalarType type,
                        const std::shared_ptr<std::byte[]>& owner) {
  return ::torch::from_blob(data, sizes, [owner](void*) {}, ::torch::TensorOptions().dtype(type));
}

double lr_of(const ShardOptimizerOptions& o) {
  return std::visit([](const auto& x) { return x.lr(); }, o);
}

}  // namespace

struct COHORT_HIDDEN ZeroOptimizer::State {
  struct Bucket {
    std::byte* grad = nullptr;        // the reducer's bucket
    std::byte* param = nullptr;       // the same layout in the parameter storage
    std::byte* grad_shard = nullptr;  // ZeRO-2: this rank's reduced chunk, accumulated
    size_t count = 0;                 // elements, padding included (a multiple of n)
    size_t chunk = 0;                 // count / n
    DType dtype = DType::F32;
    ::torch::ScalarType type = ::torch::kFloat;
    bool fresh = true;                // ZeRO-2: the next reduced chunk replaces the shard's contents
  };
  int rank = 0, n = 1;
  std::vector<Bucket> buckets;
  std::shared_ptr<std::byte[]> params;      // also owned by every parameter's storage
  std::shared_ptr<std::byte[]> grad_shard;  // ZeRO-2
  std::atomic<bool> synced{false};   // ZeRO-2: a bucket was reduced since zero_grad()
  std::atomic<bool> local{false};    // a backward under no_sync() left local gradients in the buckets

  Buffer mine(std::byte* bucket_data, const Bucket& b) const {
    return Buffer{bucket_data + static_cast<size_t>(rank) * b.chunk * dtype_size(b.dtype), b.chunk, b.dtype};
  }

  // ZeRO-2, in finalize(): bucket b's reduced chunk into the shard, and the
  // bucket cleared so that the next backward accumulates from zero.
  void take(size_t b, const Buffer& reduced) {
    Bucket& k = buckets[b];
    if (k.fresh) {
      std::memcpy(k.grad_shard, reduced.data, reduced.bytes());
      k.fresh = false;
    } else {
      ::torch::NoGradGuard no_grad;
      auto acc = ::torch::from_blob(k.grad_shard, {static_cast<int64_t>(k.chunk)}, ::torch::TensorOptions().dtype(k.type));
      acc.add_(::torch::from_blob(reduced.data, {static_cast<int64_t>(k.chunk)}, ::torch::TensorOptions().dtype(k.type)));
    }
    std::memset(k.grad, 0, k.count * dtype_size(k.dtype));
    synced = true;
    local = false;
  }
};

namespace {
// Every bucket of parameters, in place: rank r's chunk to every rank.
void allgather_params(ProcessGroup& group, const ZeroOptimizer::State& st) {
  std::vector<WorkPtr> works;
  for (const auto& k : st.buckets)
    if (k.count > 0) works.push_back(group.allgather(st.mine(k.param, k), Buffer{k.param, k.count, k.dtype}));
  for (auto& w : works) w->wait();
}
}  // namespace

ZeroOptimizer::ZeroOptimizer(std::shared_ptr<::torch::nn::Module> module, std::shared_ptr<ProcessGroup> group,
                             ShardOptimizerOptions optimizer, ZeroOptions opts)
    : module_(std::move(module)), group_(std::move(group)), opts_(opts), state_(std::make_shared<State>()) {
  if (!module_) throw InvalidArgument("ZeroOptimizer: the module is null");
  if (!group_) throw InvalidArgument("ZeroOptimizer: the process group is null (call cohort::init_process_group())");
  if (opts_.stage != ZeroStage::One && opts_.stage != ZeroStage::Two)
    throw InvalidArgument(fmt::format("ZeroOptimizer: stage {} does not exist; use ZeroStage::One or ZeroStage::Two "
                                      "(parameter sharding, ZeRO-3, is FSDP)",
                                      static_cast<int>(opts_.stage)));
  if (opts_.stage == ZeroStage::One && opts_.find_unused_parameters)
    throw InvalidArgument("ZeroOptimizer: find_unused_parameters is for ZeRO-2; ZeRO-1 reduces in step(), after "
                          "backward, where a parameter without a gradient simply counts as zeros. HINT: leave it off");
  const double lr = lr_of(optimizer);
  if (!(lr >= 0) || !std::isfinite(lr))
    throw InvalidArgument(fmt::format("ZeroOptimizer: the learning rate must be a finite number >= 0 (got {})", lr));
  if (group_->cuda_device() >= 0)
    throw InvalidArgument(fmt::format("ZeroOptimizer: the {} backend moves GPU memory; ZeRO runs on a CPU module with a "
                                      "host group (native or mpi) for now (docs/zero.md). HINT: init the group with "
                                      "the native backend",
                                      group_->backend_name()));
  for (auto& item : module_->named_parameters(true))
    if (!item.value().device().is_cpu())
      throw InvalidArgument(fmt::format("ZeroOptimizer: parameter '{}' is on {}; ZeRO runs on CPU modules for now "
                                        "(docs/zero.md). HINT: keep the module on the CPU, or use "
                                        "DistributedDataParallel for a GPU module",
                                        item.key(), item.value().device().str()));

  State& st = *state_;
  st.rank = group_->rank();
  st.n = group_->size();
  DistributedDataParallelOptions d;
  d.bucket_cap_mb = opts_.bucket_cap_mb;
  d.first_bucket_mb = opts_.first_bucket_mb;
  d.find_unused_parameters = opts_.find_unused_parameters;
  d.gradient_as_bucket_view = true;
  d.broadcast_buffers = opts_.broadcast_buffers;
  d.reduce_at_world_size_1 = true;  // one code path at every world size
  d.bucket_count_multiple = static_cast<size_t>(st.n);
  if (opts_.stage == ZeroStage::Two) {
    d.comm_hook = [s = state_](ddp::GradBucket& bucket) -> ddp::CommFuture {
      const Buffer all = bucket.buffer();
      if (all.count == 0) return {};
      const Buffer mine = s->mine(static_cast<std::byte*>(all.data), s->buckets[bucket.index()]);
      WorkPtr work = bucket.group().reduce_scatter(all, mine, {.op = ReduceOp::Avg, .timeout = bucket.timeout()});
      return {std::move(work), [s, b = bucket.index(), mine] { s->take(b, mine); }};
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
  st.params = group_->allocate_buffer(std::max<size_t>(total, 1));
  if (opts_.stage == ZeroStage::Two) {
    st.grad_shard = std::shared_ptr<std::byte[]>(new std::byte[std::max<size_t>(shard_total, 1)]());
  }
  std::vector<::torch::Tensor> trainable;
  for (auto& item : module_->named_parameters(true))
    if (item.value().requires_grad()) trainable.push_back(item.value());  // DDP's order

  ::torch::NoGradGuard no_grad;
  st.buckets.resize(plan.size());
  std::vector<::torch::Tensor> shard_params;
  for (size_t b = 0; b < plan.size(); ++b) {
    State::Bucket& k = st.buckets[b];
    k.grad = static_cast<std::byte*>(reducer.bucket_data(b));
    k.param = st.params.get() + at[b];
    k.count = plan[b].count;
    k.chunk = k.count / static_cast<size_t>(st.n);
    k.dtype = plan[b].dtype;
    if (st.grad_shard) k.grad_shard = st.grad_shard.get() + shard_at[b];
    for (size_t j = 0; j < plan[b].params.size(); ++j) {
      ::torch::Tensor& p = trainable.at(plan[b].params[j]);
      k.type = p.scalar_type();
      std::byte* slot = k.param + plan[b].offsets[j] * dtype_size(k.dtype);
      auto moved = view_of(slot, p.sizes(), p.scalar_type(), st.params);
      moved.copy_(p);
      p.set_data(moved);  // the module's parameter now lives in the bucket
    }
    if (k.chunk == 0) continue;
    auto sp = view_of(st.mine(k.param, k).data, {static_cast<int64_t>(k.chunk)}, k.type, st.params);
    sp.requires_grad_(true);
    sp.mutable_grad() = opts_.stage == ZeroStage::Two
                            ? view_of(k.grad_shard, {static_cast<int64_t>(k.chunk)}, k.type, st.grad_shard)
                            : ::torch::from_blob(st.mine(k.grad, k).data, {static_cast<int64_t>(k.chunk)},
                                                 ::torch::TensorOptions().dtype(k.type));
    shard_params.push_back(sp);
  }
  if (shard_params.empty())
    throw InvalidArgument("ZeroOptimizer: the module has no trainable parameter with elements: nothing to shard");
  std::visit(
      [&](const auto& o) {
        using O = std::decay_t<decltype(o)>;
        if constexpr (std::is_same_v<O, ::torch::optim::SGDOptions>)
          optimizer_ = std::make_unique<ShardSgd>(shard_params, o);
        else if constexpr (std::is_same_v<O, ::torch::optim::AdamOptions>)
          optimizer_ = std::make_unique<ShardAdam>(shard_params, o);
        else
          optimizer_ = std::make_unique<ShardAdamW>(shard_params, o);
      },
      optimizer);
}

ZeroOptimizer::~ZeroOptimizer() {
  accumulate_only_.reset();
  optimizer_.reset();
  ddp_.reset();  // leaves .grad as copies of the buckets
}

void ZeroOptimizer::pre_forward() { ddp_->pre_forward(); }

ddp::NoSyncGuard ZeroOptimizer::no_sync() {
  state_->local = true;
  return ddp_->no_sync();
}

void ZeroOptimizer::zero_grad() {
  State& st = *state_;
  // ZeRO-2 clears each bucket once it is reduced: only local (no_sync)
  // accumulation can be left in them. ZeRO-1 accumulates there always.
  if (opts_.stage == ZeroStage::One || st.local.load()) {
    for (auto& k : st.buckets) std::memset(k.grad, 0, k.count * dtype_size(k.dtype));
    st.local = false;
  }
  for (auto& k : st.buckets) k.fresh = true;
  st.synced = false;
  reduced_ = false;
  gather_grads_into_buckets();  // .grad set to none by the user: back to the bucket views (zeros)
}

// .grad of every parameter as a view of its bucket slot again: a gradient
// backward made fresh (after the user set .grad to none) is copied in, a
// missing one counts as zeros.
void ZeroOptimizer::gather_grads_into_buckets() {
  ::torch::NoGradGuard no_grad;
  ddp::Reducer& reducer = ddp_->reducer();
  size_t i = 0;
  for (auto& item : module_->named_parameters(true)) {
    ::torch::Tensor& p = item.value();
    if (!p.requires_grad()) continue;
    void* slot = reducer.bucket_slot(i);
    auto& g = p.mutable_grad();
    if (p.numel() > 0 && (!g.defined() || g.data_ptr() != slot)) {
      auto view = ::torch::from_blob(slot, p.sizes(), p.options());
      if (g.defined()) view.copy_(g);
      else view.zero_();
      g = view;
      reducer.set_grad(i, slot);
    }
    ++i;
  }
}

void ZeroOptimizer::reduce_for_step() {
  State& st = *state_;
  if (opts_.stage == ZeroStage::Two) {
    if (st.local.load() && !st.synced.load())
      throw InvalidArgument("ZeroOptimizer: every backward since zero_grad() ran under no_sync(), so no gradient was "
                            "reduced; HINT: run the last micro-batch's backward outside no_sync()");
    for (auto& k : st.buckets)  // a bucket no backward reduced (no gradients at all): zeros
      if (k.fresh && k.chunk > 0) std::memset(k.grad_shard, 0, k.chunk * dtype_size(k.dtype));
    return;
  }
  if (reduced_) return;
  gather_grads_into_buckets();
  std::vector<WorkPtr> works;
  for (auto& k : st.buckets)
    if (k.count > 0)
      works.push_back(group_->reduce_scatter(Buffer{k.grad, k.count, k.dtype}, st.mine(k.grad, k), {.op = ReduceOp::Avg}));
  for (auto& w : works) w->wait();
  reduced_ = true;
}

std::vector<::torch::Tensor> ZeroOptimizer::shard_grads() const {
  std::vector<::torch::Tensor> out;
  for (auto& p : optimizer_->param_groups().at(0).params()) out.push_back(p.grad());
  return out;
}

double ZeroOptimizer::clip_grad_norm(double max_norm) {
  if (!(max_norm > 0) || !std::isfinite(max_norm))
    throw InvalidArgument(fmt::format("ZeroOptimizer::clip_grad_norm: max_norm must be a finite number > 0 (got {})",
                                      max_norm));
  reduce_for_step();
  ::torch::NoGradGuard no_grad;
  double squares = 0;
  for (auto& g : shard_grads()) squares += g.to(::torch::kDouble).square().sum().item<double>();
  const double norm = std::sqrt(allreduce_scalar(*group_, squares, ReduceOp::Sum));
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
  allgather_params(*group_, *state_);
}

bool ZeroOptimizer::step(GradScaler& scaler) {
  reduce_for_step();
  const bool stepped = scaler.step(*optimizer_, group_.get());  // the same decision on every rank
  if (stepped) allgather_params(*group_, *state_);
  return stepped;
}

double ZeroOptimizer::lr() const { return optimizer_->param_groups().at(0).options().get_lr(); }
void ZeroOptimizer::set_lr(double lr) {
  if (!(lr >= 0) || !std::isfinite(lr))
    throw InvalidArgument(fmt::format("ZeroOptimizer::set_lr: the learning rate must be a finite number >= 0 (got {})", lr));
  optimizer_->param_groups().at(0).options().set_lr(lr);
}

::torch::optim::Optimizer& ZeroOptimizer::shard_optimizer() { return *optimizer_; }

ZeroMemory ZeroOptimizer::memory() const {
  ZeroMemory m;
  for (auto& item : module_->named_parameters(true))
    if (item.value().requires_grad()) m.params += static_cast<size_t>(item.value().numel());
  for (const auto& k : state_->buckets) {
    m.padded += k.count;
    m.shard += k.chunk;
    m.param_bytes += k.count * dtype_size(k.dtype);
    if (k.grad_shard) m.grad_shard_bytes += k.chunk * dtype_size(k.dtype);
  }
  m.grad_bytes = m.param_bytes;
  for (const auto& [key, s] : optimizer_->state()) {
    (void)key;
    if (auto* a = dynamic_cast<::torch::optim::AdamParamState*>(s.get())) {
      m.optimizer_state_bytes += a->exp_avg().nbytes() + a->exp_avg_sq().nbytes();
      if (a->max_exp_avg_sq().defined()) m.optimizer_state_bytes += a->max_exp_avg_sq().nbytes();
    } else if (auto* w = dynamic_cast<::torch::optim::AdamWParamState*>(s.get())) {
      m.optimizer_state_bytes += w->exp_avg().nbytes() + w->exp_avg_sq().nbytes();
      if (w->max_exp_avg_sq().defined()) m.optimizer_state_bytes += w->max_exp_avg_sq().nbytes();
    } else if (auto* g = dynamic_cast<::torch::optim::SGDParamState*>(s.get())) {
      if (g->momentum_buffer().defined()) m.optimizer_state_bytes += g->momentum_buffer().nbytes();
    }
  }
  return m;
}

}  // namespace cohort::torch
