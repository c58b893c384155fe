// GradScaler, global-norm clipping and the learning-rate schedule.
#include <ATen/autocast_mode.h>
#include <torch/version.h>
#include <fmt/format.h>

#include <cmath>

#include "cohort/torch.hpp"
#include "cohort/torch_train.hpp"
#include "autocast_state.hpp"

namespace cohort::torch {

GradScaler::GradScaler(GradScalerOptions o) : o_(o), scale_(o.init_scale) {
  if (!(o.init_scale > 0) || !std::isfinite(o.init_scale))
    throw InvalidArgument(fmt::format("GradScaler: init_scale must be a positive finite number (got {})", o.init_scale));
  if (!(o.growth_factor > 1) || !std::isfinite(o.growth_factor))
    throw InvalidArgument(fmt::format("GradScaler: growth_factor must be greater than 1 (got {})", o.growth_factor));
  if (!(o.backoff_factor > 0 && o.backoff_factor < 1))
    throw InvalidArgument(fmt::format("GradScaler: backoff_factor must be between 0 and 1 (got {})", o.backoff_factor));
  if (o.growth_interval < 1)
    throw InvalidArgument(fmt::format("GradScaler: growth_interval must be at least 1 (got {})", o.growth_interval));
}

::torch::Tensor GradScaler::scale(const ::torch::Tensor& loss) const {
  if (unscaled_)
    throw InvalidArgument("GradScaler::scale: unscale() was called but step() was not; HINT: call step() after every "
                          "unscale(), also when unscale() found inf/NaN (step() then skips the optimizer and backs off "
                          "the scale)");
  return o_.enabled ? loss * scale_ : loss;
}

bool GradScaler::unscale(::torch::optim::Optimizer& optimizer, ProcessGroup* group) {
  if (!o_.enabled) return true;
  if (unscaled_)
    throw InvalidArgument("GradScaler::unscale: already called since the last step(); the gradients would be divided "
                          "by the scale twice. HINT: call unscale() at most once per step, before step()");
  // Marked before dividing: if anything below throws, a retried step() must
  // neither divide again nor step on gradients it could not check.
  unscaled_ = true;
  found_inf_ = true;
  ::torch::NoGradGuard no_grad;
  const double inv = 1.0 / scale_;
  // One flag on the gradients' device, read once: a GPU syncs once per step, not once per parameter.
  ::torch::Tensor nonfinite;
  for (auto& g : optimizer.param_groups())
    for (auto& p : g.params()) {
      if (!p.grad().defined()) continue;
      p.mutable_grad().mul_(inv);
      ::torch::Tensor bad = ::torch::isfinite(p.grad()).logical_not().any();
      nonfinite = nonfinite.defined() ? nonfinite.logical_or(bad.to(nonfinite.device())) : bad;
    }
  double found_inf = nonfinite.defined() && nonfinite.item<bool>() ? 1.0 : 0.0;
  // Every rank must take the same decision, or the replicas drift apart.
  if (group != nullptr && group->size() > 1) found_inf = allreduce_scalar(*group, found_inf, ReduceOp::Max);
  found_inf_ = found_inf > 0;
  return !found_inf_;
}

bool GradScaler::step(::torch::optim::Optimizer& optimizer, ProcessGroup* group) {
  if (!o_.enabled) {
    optimizer.step();
    return true;
  }
  if (!unscaled_) unscale(optimizer, group);
  unscaled_ = false;
  if (found_inf_) {
    scale_ *= o_.backoff_factor;
    tracker_ = 0;
    ++skipped_;
    return false;
  }
  optimizer.step();
  if (++tracker_ >= o_.growth_interval) {
    scale_ *= o_.growth_factor;
    tracker_ = 0;
  }
  return true;
}

namespace detail {

// LibTorch 2.4 on: one autocast API per device type; before: the CPU and
// CUDA ones by name (deprecated since).
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
bool autocast_on(c10::DeviceType device) { return at::autocast::is_autocast_enabled(device); }
::torch::ScalarType autocast_dtype(c10::DeviceType device) { return at::autocast::get_autocast_dtype(device); }
void set_autocast(c10::DeviceType device, bool enabled, ::torch::ScalarType dtype) {
  at::autocast::set_autocast_enabled(device, enabled);
  at::autocast::set_autocast_dtype(device, dtype);
}
#else
bool autocast_on(c10::DeviceType device) {
  return device == c10::DeviceType::CUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
}
::torch::ScalarType autocast_dtype(c10::DeviceType device) {
  return device == c10::DeviceType::CUDA ? at::autocast::get_autocast_gpu_dtype() : at::autocast::get_autocast_cpu_dtype();
}
void set_autocast(c10::DeviceType device, bool enabled, ::torch::ScalarType dtype) {
  if (device == c10::DeviceType::CUDA) {
    at::autocast::set_enabled(enabled);
    at::autocast::set_autocast_gpu_dtype(dtype);
  } else {
    at::autocast::set_cpu_enabled(enabled);
    at::autocast::set_autocast_cpu_dtype(dtype);
  }
}
#endif

}  // namespace detail

using detail::autocast_dtype;
using detail::autocast_on;
using detail::set_autocast;

namespace {
// Checked before the previous state is read (LibTorch throws its own error for other devices).
c10::DeviceType autocast_device(c10::DeviceType device) {
  if (device != c10::DeviceType::CPU && device != c10::DeviceType::CUDA)
    throw InvalidArgument(fmt::format("Autocast: autocast runs on the CPU or a CUDA GPU, not on {}",
                                      c10::DeviceTypeName(device, /*lower_case=*/true)));
  return device;
}
}  // namespace

Autocast::Autocast(::torch::ScalarType dtype, bool enabled, c10::DeviceType device)
    : device_(autocast_device(device)), prev_enabled_(autocast_on(device)), prev_dtype_(autocast_dtype(device)) {
  if (enabled && device == c10::DeviceType::CPU && dtype != ::torch::kBFloat16)
    throw InvalidArgument(fmt::format("Autocast: LibTorch's CPU autocast runs in bfloat16 only (got {}); HINT: use "
                                      "torch::kBFloat16, or cast the model yourself",
                                      c10::toString(dtype)));
  if (enabled && device == c10::DeviceType::CUDA && dtype != ::torch::kHalf && dtype != ::torch::kBFloat16)
    throw InvalidArgument(fmt::format("Autocast: CUDA autocast runs in float16 or bfloat16 (got {})",
                                      c10::toString(dtype)));
  set_autocast(device, enabled, enabled ? dtype : prev_dtype_);
  at::autocast::increment_nesting();
}

bool autocast_enabled(c10::DeviceType device) { return autocast_on(device); }

Autocast::~Autocast() {
  // The cached casts of the weights live as long as the outermost scope.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  set_autocast(device_, prev_enabled_, prev_dtype_);
}

void zero_grad(::torch::optim::Optimizer& optimizer, bool set_to_none) {
  if (!set_to_none) {
    optimizer.zero_grad();
    return;
  }
  for (auto& group : optimizer.param_groups())
    for (auto& p : group.params()) p.mutable_grad().reset();
}

double clip_grad_norm(const std::vector<::torch::Tensor>& params, double max_norm) {
  ::torch::NoGradGuard no_grad;
  double sq = 0.0;
  for (const auto& p : params)
    if (p.grad().defined()) sq += p.grad().to(::torch::kDouble).pow(2).sum().item<double>();
  double norm = std::sqrt(sq);
  if (norm > max_norm && norm > 0) {
    double coef = max_norm / (norm + 1e-6);
    for (const auto& p : params)
      if (p.grad().defined()) p.grad().mul_(coef);
  }
  return norm;
}

double warmup_cosine_lr(int64_t step, int64_t warmup_steps, int64_t total_steps, double peak, double final_fraction) {
  if (warmup_steps > 0 && step < warmup_steps) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  if (total_steps <= warmup_steps) return peak;
  double t = static_cast<double>(step - warmup_steps) / static_cast<double>(total_steps - warmup_steps);
  t = std::min(1.0, std::max(0.0, t));
  double lo = peak * final_fraction;
  return lo + (peak - lo) * 0.5 * (1.0 + std::cos(M_PI * t));
}

}  // namespace cohort::torch
