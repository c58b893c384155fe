// Where `cohort bench` keeps its buffers: host memory (--device cpu) or GPU
// memory (--device cuda, with the nccl backend). The check patterns are always
// written and read in host copies (bench_colls.cpp); with cuda they are copied
// to the device before a run and back after it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cohort/cohort.hpp"

namespace cohort::tools {

enum class BenchDevice { Cpu, Cuda };

// "cpu" or "cuda"; InvalidArgument otherwise, and for "cuda" in a build without CUDA.
BenchDevice parse_bench_device(const std::string& s);

class BenchMemory {
 public:
  // Host buffers of the given sizes, and with cuda their device twins (cudaMalloc
  // on the current device: init_process_group has set it to the rank's GPU).
  // With `shared_from` (cpu only) the host buffers come from its
  // allocate_buffer(), as DDP's buckets do (--shared-buffers).
  static std::unique_ptr<BenchMemory> make(BenchDevice d, size_t send_bytes, size_t recv_bytes,
                                           ProcessGroup* shared_from = nullptr);
  virtual ~BenchMemory() = default;

  uint8_t* host_send() { return reinterpret_cast<uint8_t*>(host_send_.get()); }
  uint8_t* host_recv() { return reinterpret_cast<uint8_t*>(host_recv_.get()); }
  // The buffers a collective gets: the host buffers themselves, or the device twins.
  virtual void* send() = 0;
  virtual void* recv() = 0;
  // Copies the first bytes of both host buffers to the device twins, or back (no-ops for cpu).
  virtual void upload(size_t send_bytes, size_t recv_bytes) = 0;
  virtual void download(size_t send_bytes, size_t recv_bytes) = 0;
  // Runs a small control collective (header lines, timings, wrong counts) on
  // host data: `run` gets buffers the backend accepts holding `in`, and its
  // Work is waited for; then `out` gets what it wrote.
  virtual void exchange(const void* in, size_t in_bytes, void* out, size_t out_bytes,
                        const std::function<WorkPtr(void* in, void* out)>& run) = 0;

 protected:
  BenchMemory(std::shared_ptr<std::byte[]> send, std::shared_ptr<std::byte[]> recv)
      : host_send_(std::move(send)), host_recv_(std::move(recv)) {}
  std::shared_ptr<std::byte[]> host_send_, host_recv_;
};

}  // namespace cohort::tools
