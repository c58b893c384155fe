// DistributedDataParallel for LibTorch: autograd hooks feed the
// framework-neutral ddp::Reducer (src/ddp/).
//
// Where the hooks sit: a post hook on each parameter's gradient accumulator
// (the node that adds a fresh gradient into .grad). When it runs, .grad holds
// this backward's accumulated gradient, so the reducer can take it as is:
// it copies it into the bucket (except, on one host, the block this rank
// reduces itself, which the allreduce reads from .grad), or nothing at all
// when .grad already is the bucket's view.
// The first hook of a backward queues an engine callback that runs when
// backward completes and calls Reducer::finalize(): waits for every bucket's
// allreduce and writes the averages into .grad. So loss.backward() returns
// with averaged gradients, as in PyTorch.
#include <cstring>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <fmt/format.h>

#include "cohort/timeline.hpp"
#include "cohort/torch.hpp"
#include "backward_callback.hpp"
#include "device.hpp"

namespace cohort::torch {
namespace {

class GradReadyHook final : public ::torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(DistributedDataParallel* ddp, size_t index) : ddp_(ddp), index_(index) {}
  ::torch::autograd::variable_list operator()(const ::torch::autograd::variable_list& outputs,
                                              const ::torch::autograd::variable_list& /*inputs*/) override {
    ddp_->on_grad_ready(index_);
    return outputs;
  }

 private:
  DistributedDataParallel* ddp_;
  size_t index_;
};

}  // namespace

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<::torch::nn::Module> module,
                                                 std::shared_ptr<ProcessGroup> group, DistributedDataParallelOptions opts)
    : module_(std::move(module)), group_(std::move(group)), opts_(std::move(opts)) {
  if (!module_) throw InvalidArgument("DistributedDataParallel: the module is null");
  if (!group_) throw InvalidArgument("DistributedDataParallel: the process group is null (call cohort::init_process_group())");
  std::vector<::torch::Tensor> frozen;  // not trained here, but every replica must start from rank 0's values
  std::vector<std::string> frozen_names;
  for (auto& item : module_->named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) {
      frozen.push_back(item.value());
      frozen_names.push_back(item.key());
      continue;
    }
    if (!item.value().is_contiguous())
      throw InvalidArgument(fmt::format("DistributedDataParallel: parameter '{}' is not contiguous", item.key()));
    names_.push_back(item.key());
    params_.push_back(item.value());
  }
  for (auto& b : module_->named_buffers(true)) {
    buffers_.push_back(b.value());
    buffer_names_.push_back(b.key());
  }

  {
    // One device for everything, and one that fits the group (device.hpp).
    std::vector<std::string> all_names = names_;
    all_names.insert(all_names.end(), frozen_names.begin(), frozen_names.end());
    all_names.insert(all_names.end(), buffer_names_.begin(), buffer_names_.end());
    std::vector<::torch::Tensor> all_tensors = params_;
    all_tensors.insert(all_tensors.end(), frozen.begin(), frozen.end());
    all_tensors.insert(all_tensors.end(), buffers_.begin(), buffers_.end());
    device_ = common_device(all_names, all_tensors);
    mode_ = memory_mode(device_, *group_);
    if (mode_ == MemoryMode::Staged && opts_.gradient_as_bucket_view)
      throw InvalidArgument(fmt::format(
          "DistributedDataParallel: gradient_as_bucket_view needs the buckets on the module's device, but the module "
          "is on {} and the {} backend reduces host memory (its gradients are staged through host buckets). HINT: "
          "use the nccl backend for a GPU module, or leave gradient_as_bucket_view off",
          device_.str(), group_->backend_name()));
    if (opts_.recycled_buckets > 0 && opts_.wait_on_stream)
      throw InvalidArgument("DistributedDataParallel: recycled_buckets (ZeRO-2's gradient memory) needs each "
                            "bucket's collective finished on the host before its buffer is reused, and "
                            "wait_on_stream only orders the stream after it. HINT: leave wait_on_stream off");
    if (opts_.recycled_buckets > 0 && mode_ == MemoryMode::Staged)
      throw InvalidArgument(fmt::format("DistributedDataParallel: recycled_buckets (ZeRO-2's gradient memory) needs the "
                                        "buckets where the module is; this one is on {} and the {} backend reduces "
                                        "host memory. HINT: use the nccl backend for a GPU module",
                                        device_.str(), group_->backend_name()));
  }
  // Collectives below (and the reducer's) start after the work queued on
  // LibTorch's current stream (device mode; nothing otherwise).
  CudaStreamScope scope(stream());

  // Everything broadcast below is checked first, kind by kind, so a replica
  // that differs in any of it is named here rather than failing inside the broadcast.
  check_same_parameters(*group_, names_, params_, "parameter");
  check_same_parameters(*group_, frozen_names, frozen, "frozen parameter");
  check_same_parameters(*group_, buffer_names_, buffers_, "buffer");
  std::vector<::torch::Tensor> all = params_;
  all.insert(all.end(), frozen.begin(), frozen.end());
  all.insert(all.end(), buffers_.begin(), buffers_.end());
  broadcast_tensors(*group_, all, 0);

  std::vector<ddp::ParamSpec> specs;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& g = params_[i].grad();
    specs.push_back({names_[i], static_cast<size_t>(params_[i].numel()), to_dtype(params_[i].scalar_type()),
                     g.defined() ? g.data_ptr() : nullptr,
                     params_[i].dim() > 0 ? static_cast<size_t>(params_[i].size(0)) : 1});
  }
  ddp::ReducerOptions ro;
  ro.bucket_cap_mb = opts_.bucket_cap_mb;
  ro.first_bucket_mb = opts_.first_bucket_mb;
  ro.bucket_count_multiple = opts_.bucket_count_multiple;
  ro.find_unused_parameters = opts_.find_unused_parameters;
  ro.gradient_as_bucket_view = opts_.gradient_as_bucket_view;
  // .grad keeps autograd's gradient until finalize(), and lent_ keeps it alive
  // for as long as a failed allreduce might still read it.
  // (Recycled buckets: each .grad is freed as soon as it is copied.)
  ro.grads_valid_until_finalize = opts_.recycled_buckets == 0;
  ro.recycled_buckets = opts_.recycled_buckets;
  lent_.resize(params_.size());
  ro.comm_hook = opts_.comm_hook;
  memory_ = grad_memory(mode_, device_, opts_.wait_on_stream);
  if (!memory_) memory_ = ddp::host_grad_memory();
  ro.memory = memory_;
  reducer_ = std::make_unique<ddp::Reducer>(*group_, std::move(specs), std::move(ro));

  ::torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (opts_.gradient_as_bucket_view) {
      // .grad becomes a view of the bucket: autograd accumulates straight into it.
      auto view = wrap(reducer_->bucket_slot(i), params_[i].sizes(), params_[i].options());
      if (params_[i].grad().defined()) view.copy_(params_[i].grad());
      else view.zero_();
      params_[i].mutable_grad() = view;
      reducer_->set_grad(i, view.data_ptr());
    }
    // One rank has nothing to average with: no hooks, no copies, plain LibTorch speed.
    // (Recycled buckets: the hook is where the gradients go, at any size.)
    if (group_->size() == 1 && !opts_.reduce_at_world_size_1 && opts_.recycled_buckets == 0) continue;
    auto acc = ::torch::autograd::impl::grad_accumulator(params_[i]);
    hook_keys_.push_back(acc->add_post_hook(std::make_unique<GradReadyHook>(this, i)));
    accumulators_.push_back(std::move(acc));
  }
}

DistributedDataParallel::~DistributedDataParallel() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
  // A .grad that is a view of a bucket (gradient_as_bucket_view) would point
  // into freed memory once the reducer goes: it keeps its values in a copy.
  if (!opts_.gradient_as_bucket_view) return;
  try {
    ::torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      auto& g = params_[i].mutable_grad();
      if (g.defined() && g.numel() > 0 && g.data_ptr() == reducer_->bucket_slot(i)) g = g.clone();
    }
  } catch (...) {
    // Out of memory while copying: drop the gradients rather than leave them dangling.
    for (auto& p : params_)
      if (p.grad().defined() && p.grad().numel() > 0) p.mutable_grad().reset();
  }
}

void* DistributedDataParallel::stream() const {
  return mode_ == MemoryMode::Device ? current_stream_handle(device_) : nullptr;
}

void DistributedDataParallel::pre_forward() {
  forwarded_.store(true);
  callback_queued_.store(false);
  if (::torch::GradMode::is_enabled()) reducer_->prepare_for_backward();
  if (opts_.broadcast_buffers && !buffers_.empty() && group_->size() > 1) broadcast_tensors(*group_, buffers_, 0);
}

// The adapter's own share of a step on the timeline (COHORT_TIMELINE; one
// relaxed load each when it is off): each hook, and finalize with its re-pointing of .grad.
constexpr const char* kAdapterTrack = "ddp adapter";

void DistributedDataParallel::on_grad_ready(size_t i) {
  timeline::Span span("grad ready", kAdapterTrack);
  // The buffers the forward read must be rank 0's: a program that never calls
  // pre_forward() would let the replicas' BatchNorm statistics drift apart
  // without a sound. (Checked against "never", not "not since the last step":
  // several backwards of one forward, or one pre_forward() per optimizer step
  // over several synced micro-batches, are legitimate.)
  // The cheap flag first: in_no_sync() takes the reducer's lock, and this runs for every parameter.
  if (!forwarded_.load(std::memory_order_relaxed) && opts_.broadcast_buffers && !buffers_.empty() &&
      !reducer_->in_no_sync())
    throw InvalidArgument(fmt::format(
        "DistributedDataParallel: backward ran but pre_forward() was never called; the module has {} buffer(s) (the "
        "first is '{}') that DDP broadcasts from rank 0 in pre_forward(), so without it the replicas would drift "
        "apart; HINT: call ddp.pre_forward() before each forward, or use ddp.forward(model, x) (or set "
        "DistributedDataParallelOptions::broadcast_buffers = false if the buffers are meant to differ)",
        buffers_.size(), buffer_names_.front()));
  // Under no_sync there is nothing to finalize, and a backward that fails
  // never runs its callbacks: queueing one there could leave the flag set and
  // skip the next synced backward's finalize (gradients never averaged).
  if (!reducer_->in_no_sync() && !callback_queued_.exchange(true)) {
    detail::queue_backward_callback([this] {
      callback_queued_.store(false);
      finalize();
    });
  }
  const auto& g = params_[i].grad();
  if (opts_.recycled_buckets > 0) {
    // ZeRO-2: a synced backward's gradient is copied into its bucket (none
    // counts as zeros) and freed; under no_sync it stays in .grad, where
    // autograd accumulates the next pass.
    check_dense(i, g);
    const bool synced = !reducer_->in_no_sync();
    // The copy into the bucket, the zeroing of a reused buffer and the
    // bucket's collective all follow autograd's current stream (which wrote g).
    CudaStreamScope scope(stream());
    reducer_->mark_ready(i, g.defined() ? g.data_ptr() : nullptr);
    if (synced) params_[i].mutable_grad().reset();
    return;
  }
  if (!g.defined()) {
    // The hook can fire without a gradient (a custom Function returned an
    // undefined one for this parameter): that counts as zeros, as in PyTorch.
    void* slot = reducer_->bucket_slot(i);
    CudaStreamScope scope(stream());
    if (!reducer_->in_no_sync() && params_[i].numel() > 0) memory_->zero_bucket(slot, params_[i].nbytes());
    reducer_->mark_ready(i, slot);
    return;
  }
  check_dense(i, g);
  lent_[i] = g;
  // A bucket this completes is reduced after the work queued on autograd's
  // current stream (which wrote g), and g is copied into it there.
  CudaStreamScope scope(stream());
  reducer_->mark_ready(i, g.data_ptr());  // finalize() registers .grad itself
}

void DistributedDataParallel::check_dense(size_t i, const ::torch::Tensor& g) const {
  if (!g.defined()) return;
  if (g.is_sparse())
    throw InvalidArgument(fmt::format("DistributedDataParallel: the gradient of '{}' is sparse (an Embedding with "
                                      "sparse=true?); cohort averages dense gradients only: make it dense",
                                      names_[i]));
  if (!g.is_contiguous() || g.scalar_type() != params_[i].scalar_type())
    throw InvalidArgument(fmt::format("DistributedDataParallel: the gradient of '{}' is not a contiguous {} tensor",
                                      names_[i], c10::toString(params_[i].scalar_type())));
}

void DistributedDataParallel::finalize() {
  timeline::Span span("finalize", kAdapterTrack);
  // What .grad is now, for every parameter: one unused in this backward may
  // have had its gradient set to none since it was last registered (the old
  // pointer is freed memory, or a slot holding an old result); with
  // find_unused_parameters it then contributes zeros.
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& g = params_[i].grad();
    reducer_->set_grad(i, g.defined() ? g.data_ptr() : nullptr);
  }
  // Under no_sync nothing was reduced: .grad keeps what autograd accumulated
  // (a fresh tensor after set to none), to be copied into the bucket by the
  // next synced backward.
  bool reduced = false;
  // In device mode finalize() waits for the buckets' collectives on the host
  // (or, with wait_on_stream, makes the current stream, the caller's in
  // autograd's end-of-backward callback, wait for them on the GPU) and queues
  // the copies of the results on the current stream: whatever reads .grad
  // afterwards is ordered after them (docs/gpu.md).
  CudaStreamScope scope(stream());
  try {
    reduced = reducer_->finalize();
  } catch (...) {
    // A bucket's allreduce may still be running and reading these gradients
    // (the reducer leaks its buckets for the same reason): never free them.
    (void)new std::vector<::torch::Tensor>(std::move(lent_));
    lent_.assign(params_.size(), {});
    throw;
  }
  for (auto& t : lent_) t.reset();
  if (!reduced) return;
  if (opts_.recycled_buckets > 0) {
    // The hook consumed every gradient, also those an unused parameter had
    // accumulated under no_sync.
    for (size_t i = 0; i < params_.size(); ++i) {
      params_[i].mutable_grad().reset();
      reducer_->set_grad(i, nullptr);
    }
    return;
  }
  timeline::Span repoint("grads to buckets", kAdapterTrack);
  ::torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    void* slot = reducer_->bucket_slot(i);
    auto& g = params_[i].mutable_grad();
    // No rank had a gradient for it (find_unused_parameters): none stays
    // none, as in PyTorch, so the optimizer leaves it alone on every replica.
    if (!g.defined() && !reducer_->used_anywhere(i)) continue;
    if (opts_.gradient_as_bucket_view) {
      // A fresh tensor from autograd (gradients set to none), or none at all
      // (unused here, used elsewhere): point .grad back at its slot, which holds the result.
      if (!g.defined() || g.data_ptr() != slot) {
        g = wrap(slot, params_[i].sizes(), params_[i].options());
        reducer_->set_grad(i, slot);
      }
    } else if (!g.defined()) {
      // Unused on this rank with its gradient set to none, used on another:
      // it gets the average, so every replica takes the same step.
      // (Staged: the slot is host memory; the gradient goes to the module's device.)
      const bool host_slot = mode_ == MemoryMode::Staged;
      g = wrap(slot, params_[i].sizes(), params_[i].options().device(host_slot ? ::torch::kCPU : device_))
              .to(device_, /*non_blocking=*/false, /*copy=*/true);
      reducer_->set_grad(i, g.data_ptr());
    }
  }
}

}  // namespace cohort::torch
