// Tensor parallelism: the communicating autograd functions and the layers
// built on them (cohort/torch_tensor_parallel.hpp, docs/parallelism.md).
#include "cohort/torch_tensor_parallel.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

#include "cohort/torch.hpp"
#include "cohort/torch_train.hpp"
#include "device.hpp"
#include "shard_state.hpp"

namespace cohort::torch::tp {

using ::torch::Tensor;
using ::torch::autograd::AutogradContext;
using ::torch::autograd::variable_list;

namespace {

Buffer buffer_of(const Tensor& t) { return Buffer{t.data_ptr(), static_cast<size_t>(t.numel()), to_dtype(t.scalar_type())}; }

// Collectives on the group's memory (host, or the nccl group's GPU), ordered
// after LibTorch's current stream there; results come back on x's device.
class Collective {
 public:
  explicit Collective(ProcessGroup& g)
      : g_(g),
        scope_(g.cuda_device() >= 0 ? current_stream_handle(::torch::Device(
                                          ::torch::kCUDA, static_cast<c10::DeviceIndex>(g.cuda_device())))
                                    : CudaStreamScope::current()) {}

  Tensor allreduce(const Tensor& x, ReduceOp op = ReduceOp::Sum) {
    Tensor in = in_group_memory(g_, x);
    Tensor out = ::torch::empty_like(in);
    wait_keeping(g_.allreduce(buffer_of(in), buffer_of(out), {.op = op}), {in, out});
    return out.to(x.device());
  }
  // [size * x.numel()] in rank order.
  Tensor allgather_flat(const Tensor& x) {
    Tensor in = in_group_memory(g_, x);
    Tensor out = ::torch::empty({g_.size() * in.numel()}, in.options());
    wait_keeping(g_.allgather(buffer_of(in), buffer_of(out)), {in, out});
    return out.to(x.device());
  }
  // x holds size() equal blocks (flat); returns the sum over ranks of block rank().
  Tensor reduce_scatter_flat(const Tensor& x) {
    Tensor in = in_group_memory(g_, x);
    Tensor out = ::torch::empty({in.numel() / g_.size()}, in.options());
    wait_keeping(g_.reduce_scatter(buffer_of(in), buffer_of(out)), {in, out});
    return out.to(x.device());
  }

 private:
  ProcessGroup& g_;
  CudaStreamScope scope_;
};

int64_t norm_dim(const Tensor& x, int64_t dim) {
  const int64_t d = dim < 0 ? dim + x.dim() : dim;
  if (d < 0 || d >= x.dim())
    throw InvalidArgument(fmt::format("tensor parallel: dimension {} is out of range for a tensor of {} dimensions", dim,
                                      x.dim()));
  return d;
}

void check_divides(const Tensor& x, int64_t dim, const ProcessGroup& g, const char* what) {
  if (x.size(dim) % g.size() != 0)
    throw InvalidArgument(fmt::format("tp::{}: dimension {} has size {}, which does not divide by the group's {} ranks",
                                      what, dim, x.size(dim), g.size()));
}

Tensor gather_impl(const Tensor& x, ProcessGroup& g, int64_t dim) {
  std::vector<int64_t> shape{g.size()};
  for (int64_t s : x.sizes()) shape.push_back(s);
  Tensor all = Collective(g).allgather_flat(x.contiguous()).view(shape);
  return ::torch::cat(all.unbind(0), dim);
}

Tensor split_impl(const Tensor& x, ProcessGroup& g, int64_t dim) {
  return x.chunk(g.size(), dim)[g.rank()].contiguous();
}

Tensor reduce_scatter_impl(const Tensor& x, ProcessGroup& g, int64_t dim) {
  Tensor blocks = ::torch::stack(x.chunk(g.size(), dim), 0).contiguous();
  std::vector<int64_t> shape(blocks.sizes().begin() + 1, blocks.sizes().end());
  return Collective(g).reduce_scatter_flat(blocks.view({-1})).view(shape);
}

ProcessGroup& group_of(AutogradContext* ctx) {
  return *reinterpret_cast<ProcessGroup*>(ctx->saved_data["group"].toInt());
}
void keep_group(AutogradContext* ctx, ProcessGroup* g, int64_t dim = 0) {
  ctx->saved_data["group"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(g));
  ctx->saved_data["dim"] = dim;
}

struct Enter : ::torch::autograd::Function<Enter> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, ProcessGroup* g) {
    keep_group(ctx, g);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {Collective(group_of(ctx)).allreduce(grad[0].contiguous()), Tensor()};
  }
};

struct Leave : ::torch::autograd::Function<Leave> {
  static Tensor forward(AutogradContext*, const Tensor& x, ProcessGroup* g) { return Collective(*g).allreduce(x.contiguous()); }
  static variable_list backward(AutogradContext*, variable_list grad) { return {grad[0], Tensor()}; }
};

struct Gather : ::torch::autograd::Function<Gather> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, ProcessGroup* g, int64_t dim) {
    keep_group(ctx, g, dim);
    return gather_impl(x, *g, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {split_impl(grad[0], group_of(ctx), ctx->saved_data["dim"].toInt()), Tensor(), Tensor()};
  }
};

struct Split : ::torch::autograd::Function<Split> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, ProcessGroup* g, int64_t dim) {
    keep_group(ctx, g, dim);
    return split_impl(x, *g, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {gather_impl(grad[0], group_of(ctx), ctx->saved_data["dim"].toInt()), Tensor(), Tensor()};
  }
};

struct ReduceScatter : ::torch::autograd::Function<ReduceScatter> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, ProcessGroup* g, int64_t dim) {
    keep_group(ctx, g, dim);
    return reduce_scatter_impl(x, *g, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {gather_impl(grad[0], group_of(ctx), ctx->saved_data["dim"].toInt()), Tensor(), Tensor()};
  }
};

struct AllGather : ::torch::autograd::Function<AllGather> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, ProcessGroup* g, int64_t dim) {
    keep_group(ctx, g, dim);
    return gather_impl(x, *g, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {reduce_scatter_impl(grad[0], group_of(ctx), ctx->saved_data["dim"].toInt()), Tensor(), Tensor()};
  }
};

// Softmax cross-entropy over a vocabulary split across the group.
struct VocabCrossEntropy : ::torch::autograd::Function<VocabCrossEntropy> {
  static Tensor forward(AutogradContext* ctx, const Tensor& logits, const Tensor& targets, ProcessGroup* g) {
    const int64_t part = logits.size(1), first = g->rank() * part;
    Collective coll(*g);
    // The row maxima over the whole vocabulary keep exp() in range.
    const Tensor max = coll.allreduce(std::get<0>(logits.max(1)).contiguous(), ReduceOp::Max);
    const Tensor shifted = logits - max.unsqueeze(1);
    const Tensor exp = shifted.exp();
    const Tensor mine = (targets >= first) & (targets < first + part);
    const Tensor local = ((targets - first) * mine).unsqueeze(1);
    const Tensor picked = shifted.gather(1, local).squeeze(1) * mine;
    // The sums of exp and the target's shifted logit, in one allreduce.
    const Tensor sums = coll.allreduce(::torch::stack({exp.sum(1), picked}, 0).contiguous());
    const Tensor sum_exp = sums[0];
    ctx->save_for_backward({exp.div_(sum_exp.unsqueeze(1)), mine, local});
    return sum_exp.log() - sums[1];
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    // d loss / d logits = softmax - one_hot(target), on this rank's columns.
    Tensor g = saved[0].clone();
    g.scatter_add_(1, saved[2], -saved[1].to(g.scalar_type()).unsqueeze(1));
    return {g * grad[0].unsqueeze(1), Tensor(), Tensor()};
  }
};

Tensor run_if_parallel(ProcessGroup& g, const Tensor& x, const std::function<Tensor()>& fn) {
  return g.size() == 1 ? x : fn();
}

std::shared_ptr<ProcessGroup> checked(std::shared_ptr<ProcessGroup> g, const char* layer) {
  if (!g) throw InvalidArgument(fmt::format("{}: the group is null (pass Mesh::group_ptr(MeshDim::tp))", layer));
  return g;
}

void check_split(const char* layer, const char* what, int64_t n, int64_t parts, const ProcessGroup& g) {
  if (n <= 0 || n % parts != 0)
    throw InvalidArgument(fmt::format("{}: {} {} does not divide by the tensor-parallel degree {}; choose a size that is "
                                      "a multiple of {} (or another --tp)",
                                      layer, what, n, g.size(), parts));
}

}  // namespace

Tensor enter(const Tensor& x, ProcessGroup& group) {
  return run_if_parallel(group, x, [&] { return Enter::apply(x, &group); });
}
Tensor leave(const Tensor& x, ProcessGroup& group) {
  return run_if_parallel(group, x, [&] { return Leave::apply(x, &group); });
}
Tensor gather(const Tensor& x, ProcessGroup& group, int64_t dim) {
  return run_if_parallel(group, x, [&] { return Gather::apply(x, &group, norm_dim(x, dim)); });
}
Tensor split(const Tensor& x, ProcessGroup& group, int64_t dim) {
  return run_if_parallel(group, x, [&] {
    const int64_t d = norm_dim(x, dim);
    check_divides(x, d, group, "split");
    return Split::apply(x, &group, d);
  });
}
Tensor reduce_scatter(const Tensor& x, ProcessGroup& group, int64_t dim) {
  return run_if_parallel(group, x, [&] {
    const int64_t d = norm_dim(x, dim);
    check_divides(x, d, group, "reduce_scatter");
    return ReduceScatter::apply(x, &group, d);
  });
}
Tensor allgather(const Tensor& x, ProcessGroup& group, int64_t dim) {
  return run_if_parallel(group, x, [&] { return AllGather::apply(x, &group, norm_dim(x, dim)); });
}

void default_linear_init(Tensor& weight, Tensor& bias) {
  ::torch::NoGradGuard no_grad;
  ::torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(weight.size(1)));
    ::torch::nn::init::uniform_(bias, -bound, bound);
  }
}

namespace {

// The full weight and bias of an [out, in] linear layer, initialised by `init`.
std::pair<Tensor, Tensor> full_linear(int64_t in, int64_t out, bool bias, const LinearInit& init) {
  Tensor w = ::torch::empty({out, in});
  Tensor b = bias ? ::torch::empty({out}) : Tensor();
  ::torch::NoGradGuard no_grad;
  (init ? init : default_linear_init)(w, b);
  return {w, b};
}

}  // namespace

ColumnParallelLinearImpl::ColumnParallelLinearImpl(std::shared_ptr<ProcessGroup> group, int64_t in, int64_t out,
                                                   ColumnParallelLinearOptions opts)
    : group_(checked(std::move(group), "ColumnParallelLinear")), opts_(std::move(opts)) {
  const int64_t tp = group_->size(), r = group_->rank();
  if (opts_.blocks < 1) throw InvalidArgument("ColumnParallelLinear: blocks must be at least 1");
  if (opts_.gather_output && opts_.blocks > 1)
    throw InvalidArgument("ColumnParallelLinear: gather_output with blocks > 1 would interleave the blocks; gather each "
                          "block's output instead");
  check_split("ColumnParallelLinear", "out_features", out, opts_.blocks * tp, *group_);
  auto [w, b] = full_linear(in, out, opts_.bias, opts_.init);
  const int64_t part = out / opts_.blocks / tp;
  auto slice = [&](const Tensor& t) {
    std::vector<int64_t> shape{opts_.blocks, out / opts_.blocks};
    for (int64_t d = 1; d < t.dim(); ++d) shape.push_back(t.size(d));
    std::vector<int64_t> local{out / tp};
    for (int64_t d = 1; d < t.dim(); ++d) local.push_back(t.size(d));
    return t.view(shape).narrow(1, r * part, part).reshape(local).clone();
  };
  weight = register_parameter("weight", slice(w));
  if (opts_.bias) bias = register_parameter("bias", slice(b));
}

Tensor ColumnParallelLinearImpl::forward_local(const Tensor& x) {
  return ::torch::nn::functional::linear(x, weight, bias);
}

Tensor ColumnParallelLinearImpl::forward(const Tensor& x) {
  const Tensor in = opts_.sequence_parallel ? allgather(x, *group_, opts_.sequence_dim) : enter(x, *group_);
  Tensor y = forward_local(in);
  return opts_.gather_output ? gather(y, *group_, -1) : y;
}

RowParallelLinearImpl::RowParallelLinearImpl(std::shared_ptr<ProcessGroup> group, int64_t in, int64_t out,
                                             RowParallelLinearOptions opts)
    : group_(checked(std::move(group), "RowParallelLinear")), opts_(std::move(opts)) {
  const int64_t tp = group_->size(), r = group_->rank();
  check_split("RowParallelLinear", "in_features", in, tp, *group_);
  auto [w, b] = full_linear(in, out, opts_.bias, opts_.init);
  weight = register_parameter("weight", w.narrow(1, r * (in / tp), in / tp).clone());
  if (opts_.bias) bias = register_parameter("bias", b);
}

Tensor RowParallelLinearImpl::forward(const Tensor& x) {
  const Tensor in = opts_.input_is_parallel ? x : split(x, *group_, -1);
  Tensor y = ::torch::nn::functional::linear(in, weight);
  y = opts_.sequence_parallel ? reduce_scatter(y, *group_, opts_.sequence_dim) : leave(y, *group_);
  return bias.defined() ? y + bias : y;
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(std::shared_ptr<ProcessGroup> group, int64_t vocab, int64_t dim,
                                                       VocabParallelEmbeddingOptions opts)
    : group_(checked(std::move(group), "VocabParallelEmbedding")), opts_(std::move(opts)) {
  const int64_t tp = group_->size();
  check_split("VocabParallelEmbedding", "the vocabulary size", vocab, tp, *group_);
  Tensor full = ::torch::empty({vocab, dim});
  {
    ::torch::NoGradGuard no_grad;
    if (opts_.init) opts_.init(full);
    else full.normal_(0, 1);
  }
  first_ = group_->rank() * (vocab / tp);
  weight = register_parameter("weight", full.narrow(0, first_, vocab / tp).clone());
}

Tensor VocabParallelEmbeddingImpl::forward(const Tensor& ids) {
  const int64_t part = weight.size(0);
  Tensor y;
  if (group_->size() == 1) {
    y = ::torch::embedding(weight, ids);
  } else {
    const Tensor mine = (ids >= first_) & (ids < first_ + part);
    y = ::torch::embedding(weight, (ids - first_) * mine) * mine.unsqueeze(-1).to(weight.scalar_type());
  }
  return opts_.sequence_parallel ? reduce_scatter(y, *group_, opts_.sequence_dim) : leave(y, *group_);
}

Tensor vocab_parallel_cross_entropy(const Tensor& local_logits, const Tensor& targets, ProcessGroup& group) {
  if (local_logits.dim() != 2 || targets.dim() != 1 || targets.size(0) != local_logits.size(0))
    throw InvalidArgument(fmt::format("vocab_parallel_cross_entropy: expected logits [N, vocab/tp] and targets [N], got "
                                      "[{}] and [{}]",
                                      fmt::join(local_logits.sizes(), ","), fmt::join(targets.sizes(), ",")));
  if (targets.scalar_type() != ::torch::kLong)
    throw InvalidArgument(fmt::format("vocab_parallel_cross_entropy: targets are {}; pass token ids as int64 (long)",
                                      c10::toString(targets.scalar_type())));
  const int64_t vocab = local_logits.size(1) * group.size();
  if (targets.numel() > 0) {
    const int64_t lo = targets.min().item<int64_t>(), hi = targets.max().item<int64_t>();
    if (lo < 0 || hi >= vocab)
      throw InvalidArgument(fmt::format("vocab_parallel_cross_entropy: target id {} is outside the vocabulary "
                                        "[0, {}) (ignore_index is not supported: leave such rows out)",
                                        lo < 0 ? lo : hi, vocab));
  }
  return VocabCrossEntropy::apply(local_logits, targets, &group);
}

namespace {
// SplitMix64: distinct, well-mixed seeds for the streams.
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace

DropoutRng::DropoutRng(uint64_t seed, const ProcessGroup& tp_group, uint64_t replica)
    : replicated_(at::detail::createCPUGenerator(mix(mix(seed) ^ mix(replica)))),
      parallel_(at::detail::createCPUGenerator(
          mix(mix(seed) ^ mix(replica) ^ mix(0x7000 + static_cast<uint64_t>(tp_group.rank()))))) {}

Tensor dropout(const Tensor& x, double p, at::Generator& gen, bool training) {
  if (!training || p == 0) return x;
  if (p < 0 || p >= 1) throw InvalidArgument(fmt::format("tp::dropout: p = {} is outside [0, 1)", p));
  Tensor keep = ::torch::empty(x.sizes(), ::torch::TensorOptions().dtype(x.scalar_type()));
  keep.bernoulli_(1 - p, gen);
  return x * keep.to(x.device()).div_(1 - p);
}

namespace {

// How a sharded parameter lies in its full tensor: split along `dim` into
// group-size parts, within each of `blocks` equal blocks along dim 0.
struct Layout {
  ProcessGroup* group;
  int64_t dim, blocks;
};

std::map<const void*, Layout> layouts(::torch::nn::Module& module) {
  std::map<const void*, Layout> out;
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (auto* c = dynamic_cast<ColumnParallelLinearImpl*>(m.get())) {
      for (const Tensor* t : {&c->weight, &c->bias})
        if (t->defined()) out[t->unsafeGetTensorImpl()] = {&c->group(), 0, c->options().blocks};
    } else if (auto* r = dynamic_cast<RowParallelLinearImpl*>(m.get())) {
      out[r->weight.unsafeGetTensorImpl()] = {&r->group(), 1, 1};
    } else if (auto* e = dynamic_cast<VocabParallelEmbeddingImpl*>(m.get())) {
      out[e->weight.unsafeGetTensorImpl()] = {&e->group(), 0, 1};
    }
  }
  return out;
}

}  // namespace

ParameterSplit split_parameters(::torch::nn::Module& module) {
  const auto sharded = layouts(module);
  ParameterSplit out;
  for (const auto& p : module.parameters())
    (sharded.count(p.unsafeGetTensorImpl()) ? out.sharded : out.replicated).push_back(p);
  return out;
}

double clip_grad_norm(::torch::nn::Module& module, double max_norm, ProcessGroup& model_parallel, int tp_rank) {
  const ParameterSplit split = split_parameters(module);
  Tensor local = ::torch::zeros({}, ::torch::kDouble);
  auto add = [&](const std::vector<Tensor>& ps) {
    for (const auto& p : ps)
      if (p.grad().defined()) local += p.grad().to(::torch::kDouble).pow(2).sum().cpu();
  };
  add(split.sharded);
  if (tp_rank == 0) add(split.replicated);
  const double norm = std::sqrt(allreduce_scalar(model_parallel, local.item<double>()));  // one host sync
  if (max_norm > 0 && norm > max_norm) {
    const double coef = max_norm / (norm + 1e-6);
    ::torch::NoGradGuard no_grad;
    for (const auto& p : module.parameters())
      if (p.grad().defined()) p.grad().mul_(coef);
  }
  return norm;
}

void sync_sequence_parallel_grads(::torch::nn::Module& module, ProcessGroup& group) {
  sync_sequence_parallel_grads(split_parameters(module).replicated, group);
}

void sync_sequence_parallel_grads(const std::vector<Tensor>& params, ProcessGroup& group) {
  if (group.size() == 1) return;
  std::vector<Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty()) return;
  std::vector<Tensor> flat;
  for (const auto& g : grads) flat.push_back(g.reshape({-1}));
  const Tensor sum = Collective(group).allreduce(::torch::cat(flat));
  ::torch::NoGradGuard no_grad;
  int64_t at = 0;
  for (auto& g : grads) {
    g.copy_(sum.narrow(0, at, g.numel()).view_as(g));
    at += g.numel();
  }
}

namespace {

// [blocks, n / blocks, ...] views of a tensor split along dim 0 in blocks.
std::vector<int64_t> blocked(const Tensor& t, int64_t blocks) {
  std::vector<int64_t> shape{blocks, t.size(0) / blocks};
  for (int64_t d = 1; d < t.dim(); ++d) shape.push_back(t.size(d));
  return shape;
}

Tensor full_of(const Tensor& shard, const Layout& l) {
  const Tensor local = shard.detach();
  if (l.group->size() == 1) return local.clone();
  if (l.dim != 0 || l.blocks == 1) return gather_impl(local, *l.group, l.dim);
  // Gather each block's parts: [blocks, part, ...] gathered along 1.
  Tensor all = gather_impl(local.view(blocked(local, l.blocks)).contiguous(), *l.group, 1);
  std::vector<int64_t> shape{-1};
  for (int64_t d = 2; d < all.dim(); ++d) shape.push_back(all.size(d));
  return all.reshape(shape);
}

Tensor slice_of(const Tensor& full, const Layout& l) {
  const int64_t n = l.group->size(), r = l.group->rank();
  if (l.dim != 0 || l.blocks == 1) return full.chunk(n, l.dim)[r];
  Tensor part = full.view(blocked(full, l.blocks)).chunk(n, 1)[r];
  std::vector<int64_t> shape{-1};
  for (int64_t d = 2; d < part.dim(); ++d) shape.push_back(part.size(d));
  return part.reshape(shape);
}

// The full tensor a slice `local` of layout `l` comes from has `local`'s
// shape with dimension l->dim times the group size: anything else (another
// model, another width) is named before any slicing.
void check_full_shape(const char* what, const std::string& name, const Tensor& full, const Tensor& local,
                      const Layout* l) {
  std::vector<int64_t> want = local.sizes().vec();
  if (l) want[static_cast<size_t>(l->dim)] *= l->group->size();
  if (full.sizes().vec() != want)
    throw InvalidArgument(fmt::format("{}: \"{}\" is [{}] in the state, but this model's {} [{}]; was the state saved "
                                      "from another model?",
                                      what, name, fmt::join(full.sizes(), ", "),
                                      l ? "full tensor (its slices put together) would be" : "tensor is",
                                      fmt::join(want, ", ")));
}

}  // namespace

std::vector<NamedTensor> full_module_state(::torch::nn::Module& module) {
  const auto where = layouts(module);
  std::vector<NamedTensor> out;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    const auto it = where.find(p.value().unsafeGetTensorImpl());
    out.push_back(to_named(p.key(), it == where.end() ? p.value().detach() : full_of(p.value(), it->second)));
  }
  for (const auto& b : module.named_buffers(/*recurse=*/true)) out.push_back(to_named(b.key(), b.value()));
  return out;
}

void load_full_module_state(::torch::nn::Module& module, const std::vector<NamedTensor>& tensors) {
  std::map<std::string, const NamedTensor*> by_name;
  for (const auto& t : tensors) by_name[t.name] = &t;
  const auto where = layouts(module);
  ::torch::NoGradGuard no_grad;
  auto load = [&](const std::string& name, Tensor& dst, const Layout* l) {
    const auto it = by_name.find(name);
    if (it == by_name.end())
      throw InvalidArgument(fmt::format("load_full_module_state: the state has no tensor \"{}\"", name));
    const Tensor full = from_named(*it->second);
    check_full_shape("load_full_module_state", name, full, dst, l);
    dst.copy_(l ? slice_of(full, *l) : full);
  };
  for (auto& p : module.named_parameters(/*recurse=*/true)) {
    const auto it = where.find(p.value().unsafeGetTensorImpl());
    load(p.key(), p.value(), it == where.end() ? nullptr : &it->second);
  }
  for (auto& b : module.named_buffers(/*recurse=*/true)) load(b.key(), b.value(), nullptr);
}

namespace {

// Parameter name by tensor, for `module`'s parameters.
std::map<const void*, std::string> names_of(::torch::nn::Module& module) {
  std::map<const void*, std::string> out;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) out[p.value().unsafeGetTensorImpl()] = p.key();
  return out;
}

constexpr const char* kStateFields[] = {"momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"};

// A one-group state by position ("group0.param<i>.<field>": optimizer_state()
// of an optimizer over `module`'s trainable parameters(), as DDP and one
// process save it, and the full state of ZeRO and FSDP) renamed by
// parameter, i being the i-th trainable parameter, under the name `names`
// (names_of) gives its tensor (tied weights have one); the saving group's
// learning rate is left out (this optimizer's groups are others). A state
// by name is returned as it is. Positions in a second group do not say
// which parameter they are: refused.
std::vector<NamedTensor> named_by_parameter(::torch::nn::Module& module, const std::vector<NamedTensor>& tensors,
                                            const std::map<const void*, std::string>& names) {
  constexpr const char* kWho = "load_full_optimizer_state";
  if (!shard::names_by_position(tensors, kWho)) return tensors;
  std::vector<const void*> trainable;
  for (const auto& p : module.parameters(/*recurse=*/true))
    if (p.requires_grad()) trainable.push_back(p.unsafeGetTensorImpl());
  std::vector<NamedTensor> out;
  for (const NamedTensor& t : tensors) {
    const auto pf = shard::param_field(t.name, kWho);  // throws for a second group
    if (!pf) continue;                                  // group0.lr
    if (pf->first >= trainable.size())
      throw InvalidArgument(fmt::format("{}: \"{}\" is for parameter {}, but the module has {} trainable ones: another "
                                        "model",
                                        kWho, t.name, pf->first, trainable.size()));
    NamedTensor renamed = t;
    renamed.name = names.at(trainable[pf->first]) + "." + pf->second;
    out.push_back(std::move(renamed));
  }
  return out;
}

}  // namespace

std::vector<NamedTensor> full_optimizer_state(::torch::nn::Module& module, ::torch::optim::Optimizer& optimizer) {
  const auto names = names_of(module);
  const auto where = layouts(module);
  const auto& groups = optimizer.param_groups();
  std::vector<NamedTensor> out;
  for (const NamedTensor& t : optimizer_state(optimizer)) {
    size_t g = 0, k = 0;
    int used = 0;
    if (std::sscanf(t.name.c_str(), "group%zu.param%zu.%n", &g, &k, &used) != 2 || used == 0) {
      out.push_back(t);  // a group's learning rate
      continue;
    }
    const Tensor& param = groups[g].params()[k];
    const auto name = names.find(param.unsafeGetTensorImpl());
    if (name == names.end()) continue;  // another stage's parameter
    const std::string field = t.name.substr(static_cast<size_t>(used));
    const auto l = where.find(param.unsafeGetTensorImpl());
    if (field == "step" || l == where.end()) {
      out.push_back(NamedTensor{name->second + "." + field, t.dtype, t.shape, t.bytes});
    } else {
      out.push_back(to_named(name->second + "." + field, full_of(from_named(t), l->second)));
    }
  }
  return out;
}

void load_full_optimizer_state(::torch::nn::Module& module, ::torch::optim::Optimizer& optimizer,
                               const std::vector<NamedTensor>& given) {
  const auto names = names_of(module);
  const std::vector<NamedTensor> tensors = named_by_parameter(module, given, names);
  std::map<std::string, const NamedTensor*> by_name;
  for (const auto& t : tensors) by_name[t.name] = &t;
  const auto where = layouts(module);
  const auto& groups = optimizer.param_groups();
  std::vector<NamedTensor> local;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (auto lr = by_name.find(fmt::format("group{}.lr", g)); lr != by_name.end()) local.push_back(*lr->second);
    for (size_t k = 0; k < groups[g].params().size(); ++k) {
      const Tensor& param = groups[g].params()[k];
      const auto name = names.find(param.unsafeGetTensorImpl());
      if (name == names.end()) continue;
      const auto l = where.find(param.unsafeGetTensorImpl());
      for (const char* field : kStateFields) {
        const auto it = by_name.find(name->second + "." + field);
        if (it == by_name.end()) continue;
        const std::string local_name = fmt::format("group{}.param{}.{}", g, k, field);
        if (std::string(field) == "step") {
          local.push_back(NamedTensor{local_name, it->second->dtype, it->second->shape, it->second->bytes});
          continue;
        }
        const Tensor full = from_named(*it->second);
        check_full_shape("load_full_optimizer_state", it->first, full, param, l == where.end() ? nullptr : &l->second);
        local.push_back(to_named(local_name, l == where.end() ? full : slice_of(full, l->second).contiguous()));
      }
    }
  }
  load_optimizer_state(optimizer, local);
}

}  // namespace cohort::torch::tp
