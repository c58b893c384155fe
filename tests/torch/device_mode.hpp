// A test's switch onto the device path of DDP, ZeroOptimizer and FSDP on a
// machine without a GPU (cohort::torch::testing::set_device_mode_on_cpu):
// memory from LibTorch's allocator, every copy and zeroing a LibTorch
// operation, streams waited on instead of the host, with the CPU as the
// device. tests/torch/ddp_cuda_test.cpp and scripts/gpu-check.sh run the
// same code on a GPU.
#pragma once

#include "torch/device.hpp"

namespace ddp_test {

// On for as long as it lives when `on`; nothing otherwise.
class DeviceModeOnCpu {
 public:
  explicit DeviceModeOnCpu(bool on) : on_(on) {
    if (on_) cohort::torch::testing::set_device_mode_on_cpu(true);
  }
  ~DeviceModeOnCpu() {
    if (on_) cohort::torch::testing::set_device_mode_on_cpu(false);
  }
  DeviceModeOnCpu(const DeviceModeOnCpu&) = delete;
  DeviceModeOnCpu& operator=(const DeviceModeOnCpu&) = delete;

 private:
  bool on_;
};

}  // namespace ddp_test
