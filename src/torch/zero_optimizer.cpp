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
#include "state_key.hpp"

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
    size_t used = 0;                  // elements of parameters (count less the padding)
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

  // ZeRO-2, in finalize(): bucket b's reduced chunk into the shard (the
  // first reduction since zero_grad() was written there directly), and the
  // bucket cleared so that the next backward accumulates from zero.
  void take(size_t b, const Buffer& reduced) {
    Bucket& k = buckets[b];
    if (reduced.data == k.grad_shard) {
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
      const State::Bucket& k = s->buckets[bucket.index()];
      // The first reduction since zero_grad() lands in the gradient shard
      // itself; a later one (synced micro-batches) in place, added in take().
      const Buffer into = k.fresh ? Buffer{k.grad_shard, k.chunk, k.dtype} : s->mine(static_cast<std::byte*>(all.data), k);
      WorkPtr work = bucket.group().reduce_scatter(all, into, {.op = ReduceOp::Avg, .timeout = bucket.timeout()});
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
      k.used += static_cast<size_t>(p.numel());
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
  m.optimizer_state_bytes = optimizer_state_bytes(*optimizer_);
  return m;
}

// ---- Sharded optimizer state ----

namespace {

enum Kind : int64_t { kSgd = 0, kAdam = 1, kAdamW = 2 };
constexpr const char* kKindNames[] = {"SGD", "Adam", "AdamW"};

Kind kind_of(::torch::optim::Optimizer& o) {
  if (dynamic_cast<::torch::optim::AdamW*>(&o)) return kAdamW;
  if (dynamic_cast<::torch::optim::Adam*>(&o)) return kAdam;
  return kSgd;
}

// A shard parameter's state tensors by field, and its step (Adam's).
struct ShardState {
  std::vector<std::pair<std::string, ::torch::Tensor>> fields;
  int64_t step = 0;
};

ShardState state_of(::torch::optim::Optimizer& o, const ::torch::Tensor& p) {
  ShardState out;
  auto it = o.state().find(state_key(p));
  if (it == o.state().end()) return out;
  const auto add = [&](const char* name, const ::torch::Tensor& t) {
    if (t.defined()) out.fields.emplace_back(name, t);
  };
  if (auto* a = dynamic_cast<::torch::optim::AdamParamState*>(it->second.get())) {
    out.step = a->step();
    add("exp_avg", a->exp_avg());
    add("exp_avg_sq", a->exp_avg_sq());
    add("max_exp_avg_sq", a->max_exp_avg_sq());
  } else if (auto* w = dynamic_cast<::torch::optim::AdamWParamState*>(it->second.get())) {
    out.step = w->step();
    add("exp_avg", w->exp_avg());
    add("exp_avg_sq", w->exp_avg_sq());
    add("max_exp_avg_sq", w->max_exp_avg_sq());
  } else if (auto* g = dynamic_cast<::torch::optim::SGDParamState*>(it->second.get())) {
    add("momentum_buffer", g->momentum_buffer());
  }
  return out;
}

template <class S>
std::unique_ptr<::torch::optim::OptimizerParamState> adam_like(const ShardState& s) {
  auto out = std::make_unique<S>();
  out->step(s.step);
  for (const auto& [name, t] : s.fields) {
    if (name == "exp_avg") out->exp_avg(t);
    if (name == "exp_avg_sq") out->exp_avg_sq(t);
    if (name == "max_exp_avg_sq") out->max_exp_avg_sq(t);
  }
  return out;
}

}  // namespace

std::vector<NamedTensor> ZeroOptimizer::state_shard() {
  const State& st = *state_;
  const auto& shard = optimizer_->param_groups().at(0).params();
  std::vector<NamedTensor> out;
  std::vector<int64_t> layout{st.n, kind_of(*optimizer_), 0, static_cast<int64_t>(st.buckets.size())};
  size_t next = 0;  // shard parameters exist for the buckets with elements, in bucket order
  for (size_t b = 0; b < st.buckets.size(); ++b) {
    const State::Bucket& k = st.buckets[b];
    layout.push_back(static_cast<int64_t>(k.used));
    layout.push_back(static_cast<int64_t>(k.count));
    if (k.chunk == 0) continue;
    const ShardState s = state_of(*optimizer_, shard.at(next++));
    layout[2] = std::max(layout[2], s.step);
    for (const auto& [field, t] : s.fields) out.push_back(to_named(fmt::format("bucket{}.{}", b, field), t));
  }
  out.push_back(make_tensor("zero.layout", {static_cast<int64_t>(layout.size())}, layout));
  return out;
}

void ZeroOptimizer::load_state_shards(const std::function<std::vector<NamedTensor>(int rank)>& read) {
  const State& st = *state_;
  std::map<int, std::map<std::string, const NamedTensor*>> by_rank;
  std::map<int, std::vector<NamedTensor>> files;
  const auto get = [&](int r) -> const std::map<std::string, const NamedTensor*>& {
    if (!by_rank.contains(r)) {
      files[r] = read(r);
      for (const auto& t : files[r]) by_rank[r][t.name] = &t;
    }
    return by_rank[r];
  };
  constexpr const char* kWho = "ZeroOptimizer::load_state_shards";
  const auto& first = get(0);
  const auto lay_it = first.find("zero.layout");
  if (lay_it == first.end() || lay_it->second->dtype != DType::I64)
    throw InvalidArgument(fmt::format("{}: rank 0's shard has no int64 \"zero.layout\": it was not written by "
                                      "ZeroOptimizer::state_shard()",
                                      kWho));
  std::vector<int64_t> lay(lay_it->second->numel());
  std::memcpy(lay.data(), lay_it->second->bytes.data(), lay.size() * sizeof(int64_t));
  if (lay.size() < 4 || lay[0] < 1 || static_cast<size_t>(lay[3]) * 2 + 4 != lay.size())
    throw InvalidArgument(fmt::format("{}: \"zero.layout\" is malformed ({} values)", kWho, lay.size()));
  const int old_n = static_cast<int>(lay[0]);
  const Kind kind = kind_of(*optimizer_);
  if (lay[1] != kind)
    throw InvalidArgument(fmt::format("{}: the checkpoint holds {} state, this optimizer is {}; HINT: resume with the "
                                      "optimizer it was written with",
                                      kWho, lay[1] >= 0 && lay[1] <= 2 ? kKindNames[lay[1]] : "unknown", kKindNames[kind]));
  if (static_cast<size_t>(lay[3]) != st.buckets.size())
    throw InvalidArgument(fmt::format("{}: the checkpoint's shard layout has {} buckets, this model has {}: another "
                                      "model or another bucket_cap_mb / first_bucket_mb; HINT: resume with the same "
                                      "model and bucket sizes",
                                      kWho, lay[3], st.buckets.size()));
  for (size_t b = 0; b < st.buckets.size(); ++b)
    if (static_cast<size_t>(lay[4 + 2 * b]) != st.buckets[b].used || lay[5 + 2 * b] % old_n != 0)
      throw InvalidArgument(fmt::format("{}: bucket {} holds {} elements in the checkpoint and {} in this model: another "
                                        "model or another bucket_cap_mb / first_bucket_mb; HINT: resume with the same "
                                        "model and bucket sizes",
                                        kWho, b, lay[4 + 2 * b], st.buckets[b].used));

  // Every new tensor is built before any is installed: a failure changes nothing.
  const auto& shard = optimizer_->param_groups().at(0).params();
  std::vector<std::pair<::torch::Tensor, ShardState>> staged;
  size_t next = 0;
  for (size_t b = 0; b < st.buckets.size(); ++b) {
    const State::Bucket& k = st.buckets[b];
    if (k.chunk == 0) continue;
    const int64_t old_chunk = lay[5 + 2 * b] / old_n;
    ShardState s{.fields = {}, .step = lay[2]};
    const std::string prefix = fmt::format("bucket{}.", b);
    for (const auto& [name, t] : first) {
      if (name.rfind(prefix, 0) != 0) continue;
      const std::string field = name.substr(prefix.size());
      auto fresh = ::torch::zeros({static_cast<int64_t>(k.chunk)}, ::torch::TensorOptions().dtype(k.type));
      // This rank's elements [lo, hi) of the bucket, from the old chunks that hold them.
      const int64_t lo = static_cast<int64_t>(st.rank) * static_cast<int64_t>(k.chunk);
      const int64_t hi = std::min<int64_t>(lo + static_cast<int64_t>(k.chunk), static_cast<int64_t>(k.used));
      for (int64_t at = lo; at < hi;) {
        const int q = static_cast<int>(at / old_chunk);
        const int64_t end = std::min<int64_t>(hi, (q + 1) * old_chunk);
        const auto& theirs = get(q);
        const auto found = theirs.find(name);
        if (found == theirs.end())
          throw InvalidArgument(fmt::format("{}: rank {}'s shard lacks \"{}\", which rank 0's has: the checkpoint is "
                                            "incomplete or mixed from two runs",
                                            kWho, q, name));
        const ::torch::Tensor old = from_named(*found->second);
        if (old.numel() != old_chunk || old.scalar_type() != k.type)
          throw InvalidArgument(fmt::format("{}: \"{}\" of rank {} has {} elements of {}; the layout says {} of {}",
                                            kWho, name, q, old.numel(), c10::toString(old.scalar_type()), old_chunk,
                                            c10::toString(k.type)));
        fresh.narrow(0, at - lo, end - at).copy_(old.narrow(0, at - q * old_chunk, end - at));
        at = end;
      }
      s.fields.emplace_back(field, fresh);
    }
    staged.emplace_back(shard.at(next++), std::move(s));
  }
  for (auto& [p, s] : staged) {
    if (s.fields.empty()) {  // saved before its first step
      optimizer_->state().erase(state_key(p));
      continue;
    }
    auto& slot = optimizer_->state()[state_key(p)];
    if (kind == kSgd) {
      auto g = std::make_unique<::torch::optim::SGDParamState>();
      g->momentum_buffer(s.fields.front().second);
      slot = std::move(g);
    } else if (kind == kAdam) {
      slot = adam_like<::torch::optim::AdamParamState>(s);
    } else {
      slot = adam_like<::torch::optim::AdamWParamState>(s);
    }
  }
}

}  // namespace cohort::torch
