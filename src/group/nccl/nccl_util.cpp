#include "group/nccl/nccl_util.hpp"

#include <fmt/format.h>
#include <sched.h>

#include <chrono>
#include <thread>

namespace cohort::group::nccl {

std::string nccl_error_text(ncclResult_t r, ncclComm_t comm) {
  std::string s = ncclGetErrorString(r);
  // ncclGetLastError's text may be older than r (NCCL's docs say so); it still
  // usually names the failing peer or socket, which the code alone does not.
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') s += fmt::format(" (NCCL's last error: {})", last);
  return s;
}

std::string cuda_error_text(cudaError_t e) {
  return fmt::format("{}: {}", cudaGetErrorName(e), cudaGetErrorString(e));
}

void check_cuda(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();
  throw Error(fmt::format("{}: {}", what, cuda_error_text(e)));
}

ncclDataType_t to_nccl(DType t) {
  switch (t) {
    case DType::F32:
      return ncclFloat32;
    case DType::F64:
      return ncclFloat64;
    case DType::F16:
      return ncclFloat16;
    case DType::BF16:
      return ncclBfloat16;
    case DType::I8:
      return ncclInt8;
    case DType::U8:
      return ncclUint8;
    case DType::I32:
      return ncclInt32;
    case DType::I64:
      return ncclInt64;
  }
  throw InvalidArgument(fmt::format("dtype value {} has no NCCL type", static_cast<int>(t)));
}

// NCCL numbers max before min; ours the other way round: map by name, never by value.
ncclRedOp_t to_nccl(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return ncclSum;
    case ReduceOp::Prod:
      return ncclProd;
    case ReduceOp::Min:
      return ncclMin;
    case ReduceOp::Max:
      return ncclMax;
    case ReduceOp::Avg:
      return ncclAvg;
  }
  throw InvalidArgument(fmt::format("reduce op value {} has no NCCL op", static_cast<int>(op)));
}

void check_device_buffer(const Buffer& b, int device, const char* op, const char* which) {
  if (b.count == 0) return;
  cudaPointerAttributes a{};
  cudaError_t e = cudaPointerGetAttributes(&a, b.data);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw InvalidArgument(
        fmt::format("{}: cannot tell where the {} buffer {} lives ({}); the nccl backend needs GPU memory "
                    "from cudaMalloc on device {}",
                    op, which, b.data, cuda_error_text(e), device));
  }
  if (a.type == cudaMemoryTypeManaged) return;
  if (a.type != cudaMemoryTypeDevice)
    throw InvalidArgument(
        fmt::format("{}: the {} buffer {} is host memory ({}), but the nccl backend moves GPU memory; "
                    "HINT: pass memory from cudaMalloc on device {}, or use COHORT_BACKEND=native for host buffers",
                    op, which, b.data, a.type == cudaMemoryTypeHost ? "pinned" : "pageable", device));
  if (a.device != device)
    throw InvalidArgument(
        fmt::format("{}: the {} buffer {} is on GPU {}, but this rank's communicator uses GPU {}; "
                    "HINT: allocate on the rank's own device (LOCAL_RANK)",
                    op, which, b.data, a.device, device));
}

DeviceGuard::DeviceGuard(int device) : device_(device) {
  if (cudaGetDevice(&prev_) != cudaSuccess) {
    (void)cudaGetLastError();
    prev_ = -1;
  }
  if (prev_ != device_) check_cuda(cudaSetDevice(device_), fmt::format("cudaSetDevice({})", device_));
}

DeviceGuard::~DeviceGuard() {
  if (prev_ >= 0 && prev_ != device_) (void)cudaSetDevice(prev_);
}

bool poll_until(core::Deadline deadline, const std::function<bool()>& step) {
  auto pause = std::chrono::microseconds(20);
  for (int round = 0;; ++round) {
    if (step()) return true;
    if (deadline.passed()) return false;
    if (round < 16) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::microseconds(1000));
    }
  }
}

}  // namespace cohort::group::nccl
