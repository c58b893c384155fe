// `cohort bench` buffers on the host, and (in a build with CUDA) on the GPU.
#include "bench_memory.hpp"

#include <fmt/format.h>

#include <cstring>

#ifdef COHORT_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace cohort::tools {
namespace {

std::shared_ptr<std::byte[]> heap(size_t bytes) { return std::shared_ptr<std::byte[]>(new std::byte[bytes == 0 ? 1 : bytes]()); }

class HostMemory final : public BenchMemory {
 public:
  HostMemory(std::shared_ptr<std::byte[]> s, std::shared_ptr<std::byte[]> r) : BenchMemory(std::move(s), std::move(r)) {}
  void* send() override { return host_send_.get(); }
  void* recv() override { return host_recv_.get(); }
  void upload(size_t, size_t) override {}
  void download(size_t, size_t) override {}
  void exchange(const void* in, size_t in_bytes, void* out, size_t out_bytes,
                const std::function<WorkPtr(void*, void*)>& run) override {
    std::vector<uint8_t> a(static_cast<const uint8_t*>(in), static_cast<const uint8_t*>(in) + in_bytes), b(out_bytes);
    run(a.data(), b.data())->wait();
    std::memcpy(out, b.data(), out_bytes);
  }
};

#ifdef COHORT_HAVE_CUDA
void cuda_check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();
  throw Error(
      fmt::format("cohort bench --device cuda: {} failed: {}: {}", what, cudaGetErrorName(e), cudaGetErrorString(e)));
}

// One cudaMalloc'd block, freed on scope exit.
struct DeviceBlock {
  void* p = nullptr;
  explicit DeviceBlock(size_t bytes) { cuda_check(cudaMalloc(&p, bytes == 0 ? 1 : bytes), "cudaMalloc"); }
  ~DeviceBlock() { (void)cudaFree(p); }
  DeviceBlock(const DeviceBlock&) = delete;
  DeviceBlock& operator=(const DeviceBlock&) = delete;
};

class CudaMemory final : public BenchMemory {
 public:
  CudaMemory(size_t s, size_t r) : BenchMemory(heap(s), heap(r)), dev_send_(s), dev_recv_(r) {}
  void* send() override { return dev_send_.p; }
  void* recv() override { return dev_recv_.p; }
  void upload(size_t s, size_t r) override {
    cuda_check(cudaMemcpy(dev_send_.p, host_send(), s, cudaMemcpyHostToDevice),
               "cudaMemcpy of the send buffer to the GPU");
    cuda_check(cudaMemcpy(dev_recv_.p, host_recv(), r, cudaMemcpyHostToDevice),
               "cudaMemcpy of the recv buffer to the GPU");
  }
  void download(size_t s, size_t r) override {
    cuda_check(cudaMemcpy(host_send(), dev_send_.p, s, cudaMemcpyDeviceToHost),
               "cudaMemcpy of the send buffer from the GPU");
    cuda_check(cudaMemcpy(host_recv(), dev_recv_.p, r, cudaMemcpyDeviceToHost),
               "cudaMemcpy of the recv buffer from the GPU");
  }
  void exchange(const void* in, size_t in_bytes, void* out, size_t out_bytes,
                const std::function<WorkPtr(void*, void*)>& run) override {
    DeviceBlock a(in_bytes), b(out_bytes);
    cuda_check(cudaMemcpy(a.p, in, in_bytes, cudaMemcpyHostToDevice), "cudaMemcpy to the GPU");
    run(a.p, b.p)->wait();
    cuda_check(cudaMemcpy(out, b.p, out_bytes, cudaMemcpyDeviceToHost), "cudaMemcpy from the GPU");
  }

 private:
  DeviceBlock dev_send_, dev_recv_;
};
#endif

}  // namespace

BenchDevice parse_bench_device(const std::string& s) {
  if (s == "cpu") return BenchDevice::Cpu;
  if (s != "cuda") throw InvalidArgument(fmt::format("--device {}: use cpu or cuda", s));
#ifndef COHORT_HAVE_CUDA
  throw InvalidArgument(
      "--device cuda: this cohort was built without CUDA; rebuild with -DCOHORT_CUDA=ON on a machine with "
      "CUDA and NCCL (docs/nccl.md)");
#else
  return BenchDevice::Cuda;
#endif
}

std::unique_ptr<BenchMemory> BenchMemory::make(BenchDevice d, size_t send_bytes, size_t recv_bytes,
                                               ProcessGroup* shared_from) {
  if (d == BenchDevice::Cuda && shared_from != nullptr)
    throw InvalidArgument("--shared-buffers is for host memory; with --device cuda NCCL manages the GPU buffers");
#ifdef COHORT_HAVE_CUDA
  if (d == BenchDevice::Cuda) return std::make_unique<CudaMemory>(send_bytes, recv_bytes);
#else
  if (d == BenchDevice::Cuda) throw InvalidArgument("--device cuda: this cohort was built without CUDA");
#endif
  if (shared_from != nullptr)
    return std::make_unique<HostMemory>(shared_from->allocate_buffer(send_bytes), shared_from->allocate_buffer(recv_bytes));
  return std::make_unique<HostMemory>(heap(send_bytes), heap(recv_bytes));
}

}  // namespace cohort::tools
