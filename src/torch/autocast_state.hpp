// Autocast's per-thread state on either LibTorch (1.x names the CPU and
// CUDA calls, 2.4 on takes the device type): train_utils.cpp's Autocast and
// recompute.cpp, which runs a function again under the autocast it first ran with.
#pragma once

#include <torch/torch.h>

namespace cohort::torch::detail {

bool autocast_on(c10::DeviceType device);
::torch::ScalarType autocast_dtype(c10::DeviceType device);
void set_autocast(c10::DeviceType device, bool enabled, ::torch::ScalarType dtype);

}  // namespace cohort::torch::detail
