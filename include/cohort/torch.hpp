// cohort/torch.hpp: DistributedDataParallel and training helpers for
// LibTorch's C++ frontend (built when CMake finds LibTorch; link cohort_torch).
//
//   auto pg = cohort::init_process_group();
//   auto model = std::make_shared<Net>();
//   cohort::torch::DistributedDataParallel ddp(model, pg);   // checks + broadcasts rank 0's weights
//   for (batch : loader) {
//     optimizer.zero_grad();
//     ddp.pre_forward();                 // broadcasts buffers (BatchNorm stats) when enabled
//     auto loss = loss_fn(model->forward(x), y);
//     loss.backward();                   // gradients are averaged while backward runs;
//                                        // when backward returns, .grad holds the average
//     optimizer.step();
//   }
//
// Gradient accumulation: { auto guard = ddp.no_sync(); loss.backward(); } for all
// but the last micro-batch. Forgetting pre_forward() is harmless without buffers;
// with buffers (and broadcast_buffers), from 2 ranks on, a synced backward of a
// program that never called it throws, naming a buffer, rather than let the
// replicas' statistics drift apart. Running a second backward before the
// first finished (e.g. retain_graph tricks across iterations) throws "Expected
// to have finished reduction ...".
#pragma once

#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "cohort/ddp.hpp"
#include "cohort/process_group.hpp"
#include "cohort/export.hpp"

namespace cohort::torch {

struct COHORT_API DistributedDataParallelOptions {
  double bucket_cap_mb = 25.0;        // PyTorch's bucket_cap_mb
  double first_bucket_mb = 1.0;
  bool find_unused_parameters = false;
  bool gradient_as_bucket_view = false;
  bool broadcast_buffers = true;      // broadcast rank 0's buffers in pre_forward()
  ddp::CommHook comm_hook;            // empty: average with allreduce
  // A group of one rank has nothing to average: by default no hooks are
  // installed and backward runs at plain LibTorch speed. True runs the
  // reducer anyway, as PyTorch does (the GPU check uses it to exercise the
  // device buckets on one GPU).
  bool reduce_at_world_size_1 = false;
  // A CUDA module on the nccl backend. By default backward() waits on the
  // host for the buckets' allreduces, so a failed or hung peer fails this
  // very backward(). True returns as soon as the current stream is ordered
  // after them (as PyTorch's DDP does): the CPU can queue the optimizer step
  // while the GPU finishes, and a failure is thrown by the next step's
  // pre_forward() or the group's next collective, after the optimizer has
  // applied that step (docs/gpu.md).
  bool wait_on_stream = false;
  // Pads every bucket to a multiple of this many elements (ReducerOptions::
  // bucket_count_multiple). ZeroOptimizer sets it to the world size.
  size_t bucket_count_multiple = 1;
  // ZeRO-2's (ReducerOptions::recycled_buckets): 0, every bucket keeps its
  // own buffer. K > 0, for a module on the CPU with a host group or on a GPU
  // with nccl (not staged), with a comm_hook that consumes each
  // reduced bucket: buckets take buffers from a pool of about K, each .grad
  // is set to none as soon as a synced backward has copied it into its
  // bucket, and finalize() leaves every .grad none.
  size_t recycled_buckets = 0;
};

// Where the module's gradients are reduced (src/torch/device.hpp, docs/gpu.md).
enum class MemoryMode : int;

class COHORT_API DistributedDataParallel {
 public:
  // Collective over `group`: checks that every rank has the same parameters
  // (names, shapes, dtypes; a mismatch names the parameter and the ranks),
  // broadcasts parameters and buffers from rank 0, and hooks every parameter's
  // gradient accumulator. The module lives on one device: the CPU, or a CUDA
  // GPU (on the nccl backend the group's GPU; on the native backend any GPU,
  // its gradients staged through host memory). A module split across devices,
  // or on a device that does not fit the group, is refused by name.
  DistributedDataParallel(std::shared_ptr<::torch::nn::Module> module, std::shared_ptr<ProcessGroup> group,
                          DistributedDataParallelOptions opts = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // Call at the start of each training forward.
  void pre_forward();
  // Runs pre_forward() then module->forward(args...), for typed modules.
  template <class M, class... Args>
  auto forward(M& typed_module, Args&&... args) {
    pre_forward();
    return typed_module->forward(std::forward<Args>(args)...);
  }

  [[nodiscard]] ddp::NoSyncGuard no_sync() { return reducer_->no_sync(); }
  void register_comm_hook(ddp::CommHook hook) { reducer_->register_comm_hook(std::move(hook)); }
  // Averages now if backward did not end through the autograd engine (never
  // needed after loss.backward(); harmless to call twice).
  void finalize();

  ddp::IterationStats stats() const { return reducer_->stats(); }
  // The reducer and its buckets (ZeroOptimizer shards them).
  ddp::Reducer& reducer() { return *reducer_; }
  ProcessGroup& group() { return *group_; }
  const ::torch::Device& device() const { return device_; }
  const std::shared_ptr<::torch::nn::Module>& module() const { return module_; }
  const std::vector<std::string>& param_names() const { return names_; }

  // Called by the gradient-accumulator hook of parameter i (autograd's thread).
  void on_grad_ready(size_t i);

 private:
  // LibTorch's current CUDA stream in device mode (a cudaStream_t), else nullptr.
  void* stream() const;
  // InvalidArgument unless `g` (parameter i's gradient) is none or dense, contiguous and of its dtype.
  void check_dense(size_t i, const ::torch::Tensor& g) const;
  std::shared_ptr<::torch::nn::Module> module_;
  std::shared_ptr<ProcessGroup> group_;
  DistributedDataParallelOptions opts_;
  ::torch::Device device_{::torch::kCPU};
  MemoryMode mode_;
  std::shared_ptr<ddp::GradMemory> memory_;  // the reducer's (host_grad_memory() for a CPU module)
  std::vector<::torch::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<::torch::Tensor> buffers_;
  std::vector<std::string> buffer_names_;
  // The gradients handed to the reducer this iteration: it may read them until
  // finalize() (ReducerOptions::grads_valid_until_finalize).
  std::vector<::torch::Tensor> lent_;
  std::unique_ptr<ddp::Reducer> reducer_;
  // std::shared_ptr<Node> in LibTorch 1.x, c10::intrusive_ptr<Node> in 2.x.
  using AccumulatorPtr = decltype(::torch::autograd::impl::grad_accumulator(std::declval<const ::torch::Tensor&>()));
  std::vector<AccumulatorPtr> accumulators_;
  std::vector<uintptr_t> hook_keys_;
  std::atomic<bool> callback_queued_{false};
  // pre_forward() has run at least once: with buffers to broadcast, a synced
  // backward before that is an error.
  std::atomic<bool> forwarded_{false};
};

// Broadcasts every tensor in place from `root` (contiguous tensors; moved
// through a contiguous copy otherwise).
COHORT_API void broadcast_tensors(ProcessGroup& group, const std::vector<::torch::Tensor>& tensors, int root = 0);

// Throws InvalidArgument on every rank when a rank's list differs from rank
// 0's, naming the rank and the first difference: a tensor one of them lacks,
// a shape or dtype, or the order. `what` names the tensors in the message
// ("parameter"; DistributedDataParallel checks its trainable parameters, then
// the "frozen parameter"s, then the "buffer"s).
COHORT_API void check_same_parameters(ProcessGroup& group, const std::vector<std::string>& names,
                           const std::vector<::torch::Tensor>& tensors, std::string_view what = "parameter");

// cohort's element type for a torch dtype; InvalidArgument for types collectives cannot move.
COHORT_API DType to_dtype(::torch::ScalarType t);

// Averages a scalar (loss, accuracy counts) across the group.
COHORT_API double allreduce_scalar(ProcessGroup& group, double value, ReduceOp op = ReduceOp::Sum);

// `root`'s string on every rank (a checkpoint path chosen by rank 0, ...).
COHORT_API std::string broadcast_string(ProcessGroup& group, std::string value, int root = 0);

}  // namespace cohort::torch
