// Small pieces of the NCCL backend: CUDA/NCCL result checks that throw typed
// errors, the dtype and reduce-op tables, the device-pointer check, a device
// guard, and the polling loop every non-blocking NCCL wait uses.
//
// Only files of src/group/nccl/ include this (it brings in cuda_runtime.h and
// nccl.h); they are compiled only when CMake found CUDA and NCCL.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <functional>
#include <string>

#include "cohort/process_group.hpp"
#include "core/clock.hpp"

// ncclCommSplit (2.18) and non-blocking communicators (2.14) are the oldest features we use.
#if NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error "cohort's NCCL backend needs NCCL 2.18 or newer (ncclCommSplit, non-blocking communicators)"
#endif

namespace cohort::group::nccl {

// "ncclRemoteError (remote process exited or network error): <ncclGetLastError>"
std::string nccl_error_text(ncclResult_t r, ncclComm_t comm);
// "cudaErrorInvalidValue: invalid argument"
std::string cuda_error_text(cudaError_t e);

// Throws Error "<what>: <CUDA error>" when e is not cudaSuccess (clears the
// CUDA runtime's last, non-sticky error first so that it does not leak into later calls).
void check_cuda(cudaError_t e, const std::string& what);

ncclDataType_t to_nccl(DType t);
ncclRedOp_t to_nccl(ReduceOp op);

// Throws InvalidArgument when b (of `op`, called `which`) is not memory that
// GPU `device` can use in NCCL calls: cudaMalloc'd memory of that device or
// managed memory. Empty buffers pass.
void check_device_buffer(const Buffer& b, int device, const char* op, const char* which);

// Makes `device` current for the scope (cudaSetDevice is per host thread).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
  int device_;
};

// Calls step() until it returns true or the deadline passes (then returns
// false). Between calls it yields for the first few rounds, then sleeps with a
// growing pause of up to 1 ms: 8 ranks on 2 cores must still make progress
// (docs/design.md habit 9), and a GPU collective rarely finishes within a yield.
bool poll_until(core::Deadline deadline, const std::function<bool()>& step);

}  // namespace cohort::group::nccl
