// GradScaler, global-norm clipping and the learning-rate schedule.
#include <cmath>

#include "cohort/torch.hpp"
#include "cohort/torch_train.hpp"

namespace cohort::torch {

bool GradScaler::step(::torch::optim::Optimizer& optimizer, ProcessGroup* group) {
  if (!o_.enabled) {
    optimizer.step();
    return true;
  }
  ::torch::NoGradGuard no_grad;
  const double inv = 1.0 / scale_;
  double found_inf = 0.0;
  for (auto& g : optimizer.param_groups())
    for (auto& p : g.params()) {
      if (!p.grad().defined()) continue;
      p.mutable_grad().mul_(inv);
      if (!::torch::isfinite(p.grad()).all().item<bool>()) found_inf = 1.0;
    }
  // Every rank must take the same decision, or the replicas drift apart.
  if (group != nullptr && group->size() > 1) found_inf = allreduce_scalar(*group, found_inf, ReduceOp::Max);
  if (found_inf > 0) {
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
