// Where a DistributedDataParallel module lives, and the reducer memory that
// goes with it (docs/gpu.md):
//   Host    a CPU module on a host group (native, mpi): buckets in host
//           memory, the engine's own copies (a null ReducerOptions::memory).
//   Device  a CUDA module on a group that moves GPU memory (nccl): buckets in
//           the GPU's memory from LibTorch's caching allocator; copies and the
//           compression hooks' conversions queued on LibTorch's current
//           stream; collectives ordered after that stream (CudaStreamScope).
//   Staged  a CUDA module on a host group: gradients are copied to host
//           buckets (shared memory on one host) and the results back, as
//           PyTorch's gloo does with CUDA tensors. Several ranks may share one
//           GPU this way (NCCL refuses that), and CPU-only ranks may join.
// Only device-generic c10 APIs are used (c10::Stream, the device guard
// interface): the adapter compiles against a CPU LibTorch and runs CUDA
// modules when it is linked against a CUDA one.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cohort/ddp.hpp"
#include "cohort/export.hpp"
#include "cohort/process_group.hpp"
#include "cohort/torch.hpp"

namespace cohort::torch {

enum class MemoryMode : int { Host, Device, Staged };  // declared in cohort/torch.hpp

// The one device every tensor is on, or InvalidArgument naming two tensors on
// different devices, or one on a device type cohort does not run (meta, ...).
// `names` and `tensors` run in parallel; `who` starts the error (the wrapper).
::torch::Device common_device(const std::vector<std::string>& names, const std::vector<::torch::Tensor>& tensors,
                              const char* who = "DistributedDataParallel");

// The mode for a module on `device` under `group`, or InvalidArgument saying
// why they do not fit (a CPU module on nccl, a module on another GPU than
// the group's, a CUDA module with a LibTorch without CUDA).
MemoryMode memory_mode(const ::torch::Device& device, const ProcessGroup& group,
                       const char* who = "DistributedDataParallel");

// The reducer's memory for Device and Staged modes (nullptr for Host).
// wait_on_stream: Device mode orders the current stream after the buckets'
// collectives instead of waiting on the host (DistributedDataParallelOptions::wait_on_stream).
std::shared_ptr<ddp::GradMemory> grad_memory(MemoryMode mode, const ::torch::Device& device, bool wait_on_stream);

// `n` zeroed bytes (at least 1) on `device` from LibTorch's caching allocator
// (512-byte aligned on a GPU), alive as long as the returned pointer: the
// device memory of DDP's buckets and of ZeRO's parameter buckets and shard.
std::shared_ptr<std::byte[]> device_bytes(const ::torch::Device& device, size_t n);

// `n` zeroed bytes (at least 1) of a sharded wrapper's own memory (ZeRO's
// buckets and shards, FSDP's shards and gather slots): in Host mode the
// group's (shared memory on one host, which peers may map: the single-copy
// collectives) when `shared`, else plain heap, which no peer reads; in the
// other modes device_bytes() on `device`.
std::shared_ptr<std::byte[]> own_bytes(ProcessGroup& group, MemoryMode mode, const ::torch::Device& device, size_t n,
                                       bool shared);

// Zeroes `bytes` bytes at `data`, a sharded wrapper's own memory in `mode`:
// memset in Host mode, else a kernel on `device`'s current stream.
void zero_own_bytes(std::byte* data, size_t bytes, MemoryMode mode, const ::torch::Device& device);

// LibTorch's current stream on `device`, as a cudaStream_t; nullptr for the CPU.
void* current_stream_handle(const ::torch::Device& device);

// A tensor over memory that someone else owns, on options' device. Unlike
// ::torch::from_blob it does not ask the driver where the pointer lives
// (from_blob's cudaPointerGetAttributes per call: DDP's hooks wrap every
// gradient and bucket slot each step, on the hot path).
::torch::Tensor wrap(void* data, ::torch::IntArrayRef sizes, const ::torch::TensorOptions& options);
// The same, keeping `owner` (the memory's) alive as long as the tensor.
::torch::Tensor wrap(void* data, ::torch::IntArrayRef sizes, const ::torch::TensorOptions& options,
                     std::shared_ptr<std::byte[]> owner);

// ScalarType of a cohort element type.
::torch::ScalarType to_scalar_type(DType t);

// `t` in the memory the group's collectives move: itself when it is there
// already, else a contiguous copy on the group's GPU (nccl) or the CPU.
::torch::Tensor in_group_memory(const ProcessGroup& group, const ::torch::Tensor& t);

// Waits for `work`, which reads or writes `keep`; if it fails, the tensors
// are leaked rather than freed under a transfer that may still run.
void wait_keeping(const WorkPtr& work, std::vector<::torch::Tensor> keep);

// Issues a collective on small host buffers and waits for it; on a group that
// moves GPU memory only, through tensors on its GPU (copied back after).
void host_collective(ProcessGroup& group, const std::vector<Buffer>& host,
                     const std::function<WorkPtr(const std::vector<Buffer>&)>& issue);

namespace testing {
// While on (process-wide), memory_mode() gives Device for a CPU module on a
// host group: DDP, ZeroOptimizer and the reducer then take their device
// path (memory from LibTorch's allocator, every copy, zeroing and
// conversion a LibTorch operation, buffers that are not the group's shared
// memory) with the CPU as the device. The tests run the device path's logic
// this way on machines without a GPU; scripts/gpu-check.sh runs it on one.
COHORT_API void set_device_mode_on_cpu(bool on);
bool device_mode_on_cpu();
}  // namespace testing

}  // namespace cohort::torch
