// adam_step / adamw_step: torch::optim::Adam's and AdamW's update in one pass
// over each parameter.
//
// LibTorch's Adam::step() runs about ten tensor operations per parameter
// (weight decay, two moment updates of two operations each, sqrt, a division,
// + eps, addcdiv; AdamW a decay multiply instead of the first), each reading
// and writing whole tensors, and allocating three temporaries: ~20 passes
// over the parameter's size. Here every element of the parameter, gradient
// and moments is loaded once, updated in registers and stored once: 7 passes
// (p, g, m, v read; p, m, v written), 9 with amsgrad.
//
// The arithmetic is LibTorch 1.13's, in its order, in float:
//   Adam:  g += wd p                     AdamW:  p *= 1 - lr wd
//   m = m b1 + (1 - b1) g
//   v = v b2 + (1 - b2) g g              (amsgrad: vmax = max(vmax, v), used below)
//   denom = sqrt(v) / sqrt(1 - b2^t) + eps
//   p = p + (-lr / (1 - b1^t)) m / denom
// so results agree with step() within a rounding or two per operation. The
// state (step, exp_avg, exp_avg_sq, max_exp_avg_sq) stays in the optimizer:
// optimizer_state(), checkpoints and step() itself keep working on it.
#include <cmath>

#include <fmt/format.h>

#include "cohort/error.hpp"
#include "cohort/torch_train.hpp"
#include "fused_step.hpp"
#include "state_key.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace cohort::torch {
namespace {

struct AdamConsts {
  float b1, one_minus_b1, b2, one_minus_b2;
  float sqrt_bc2;        // sqrt(1 - b2^t)
  float eps;
  float neg_step_size;   // -lr / (1 - b1^t)
  float l2;              // Adam: weight decay added to the gradient (0: none)
  float decay;           // AdamW: p *= decay first (1: none)
  bool amsgrad;
};

inline void adam_scalar(float* p, const float* g, float* m, float* v, float* vmax, int64_t i, const AdamConsts& c) {
  float pi = p[i];
  if (c.decay != 1.0f) pi = pi * c.decay;
  float gi = g[i];
  if (c.l2 != 0.0f) gi = std::fma(pi, c.l2, gi);
  const float mi = std::fma(gi, c.one_minus_b1, m[i] * c.b1);
  float vi = std::fma(c.one_minus_b2 * gi, gi, v[i] * c.b2);
  m[i] = mi;
  v[i] = vi;
  if (c.amsgrad) {
    vi = std::isnan(vi) || vi > vmax[i] ? vi : vmax[i];  // NaN propagates, as in torch::max and the vector loop
    vmax[i] = vi;
  }
  const float denom = std::sqrt(vi) / c.sqrt_bc2 + c.eps;
  p[i] = pi + (c.neg_step_size * mi) / denom;
}

void adam_portable(float* p, const float* g, float* m, float* v, float* vmax, int64_t n, const AdamConsts& c) {
  for (int64_t i = 0; i < n; ++i) adam_scalar(p, g, m, v, vmax, i, c);
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) void adam_avx2(float* p, const float* g, float* m, float* v, float* vmax, int64_t n,
                                                   const AdamConsts& c) {
  const __m256 b1 = _mm256_set1_ps(c.b1), omb1 = _mm256_set1_ps(c.one_minus_b1);
  const __m256 b2 = _mm256_set1_ps(c.b2), omb2 = _mm256_set1_ps(c.one_minus_b2);
  const __m256 sqrt_bc2 = _mm256_set1_ps(c.sqrt_bc2), eps = _mm256_set1_ps(c.eps);
  const __m256 nss = _mm256_set1_ps(c.neg_step_size), l2 = _mm256_set1_ps(c.l2), decay = _mm256_set1_ps(c.decay);
  const bool has_l2 = c.l2 != 0.0f, has_decay = c.decay != 1.0f;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 pv = _mm256_loadu_ps(p + i);
    if (has_decay) pv = _mm256_mul_ps(pv, decay);
    __m256 gv = _mm256_loadu_ps(g + i);
    if (has_l2) gv = _mm256_fmadd_ps(pv, l2, gv);
    const __m256 mv = _mm256_fmadd_ps(gv, omb1, _mm256_mul_ps(_mm256_loadu_ps(m + i), b1));
    __m256 vv = _mm256_fmadd_ps(_mm256_mul_ps(omb2, gv), gv, _mm256_mul_ps(_mm256_loadu_ps(v + i), b2));
    _mm256_storeu_ps(m + i, mv);
    _mm256_storeu_ps(v + i, vv);
    if (c.amsgrad) {
      // maxps returns its second operand when either is NaN: a NaN second
      // moment propagates (a NaN maximum only ever follows a NaN moment).
      vv = _mm256_max_ps(_mm256_loadu_ps(vmax + i), vv);
      _mm256_storeu_ps(vmax + i, vv);
    }
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vv), sqrt_bc2), eps);
    _mm256_storeu_ps(p + i, _mm256_add_ps(pv, _mm256_div_ps(_mm256_mul_ps(nss, mv), denom)));
  }
  for (; i < n; ++i) adam_scalar(p, g, m, v, vmax, i, c);
}
#endif

void adam_fused(float* p, const float* g, float* m, float* v, float* vmax, int64_t n, const AdamConsts& c) {
#if defined(__x86_64__)
  if (have_avx2_fma()) return adam_avx2(p, g, m, v, vmax, n, c);
#endif
  adam_portable(p, g, m, v, vmax, n, c);
}

// The same update with LibTorch's tensor operations, for what the loop does not
// handle (other dtypes, non-contiguous tensors).
template <class Options, class State>
void adam_unfused(::torch::Tensor& p, ::torch::Tensor grad, State& s, const Options& o, bool decoupled, double bc1, double bc2) {
  if (o.weight_decay() != 0) {
    if (decoupled)
      p.mul_(1 - o.lr() * o.weight_decay());
    else
      grad = grad.add(p, o.weight_decay());
  }
  const double b1 = std::get<0>(o.betas()), b2 = std::get<1>(o.betas());
  s.exp_avg().mul_(b1).add_(grad, 1 - b1);
  s.exp_avg_sq().mul_(b2).addcmul_(grad, grad, 1 - b2);
  ::torch::Tensor second = s.exp_avg_sq();
  if (o.amsgrad()) {
    ::torch::max_out(s.max_exp_avg_sq(), s.exp_avg_sq(), s.max_exp_avg_sq());
    second = s.max_exp_avg_sq();
  }
  auto denom = (second.sqrt() / std::sqrt(bc2)).add_(o.eps());
  p.addcdiv_(s.exp_avg(), denom, -o.lr() / bc1);
}

// The parameter's state in the optimizer, made as LibTorch makes it (step 0,
// zero moments in p's memory format) if it has none.
template <class State, class Optimizer>
State& adam_state(Optimizer& optimizer, const ::torch::Tensor& p, bool amsgrad) {
  auto& slot = optimizer.state()[state_key(p)];
  if (!slot) {
    auto s = std::make_unique<State>();
    s->step(0);
    s->exp_avg(::torch::zeros_like(p, ::torch::MemoryFormat::Preserve));
    s->exp_avg_sq(::torch::zeros_like(p, ::torch::MemoryFormat::Preserve));
    if (amsgrad) s->max_exp_avg_sq(::torch::zeros_like(p, ::torch::MemoryFormat::Preserve));
    slot = std::move(s);
  }
  auto& s = static_cast<State&>(*slot);
  if (amsgrad && !s.max_exp_avg_sq().defined())  // amsgrad switched on after steps without it
    s.max_exp_avg_sq(::torch::zeros_like(p, ::torch::MemoryFormat::Preserve));
  return s;
}

template <class Options, class State, class Optimizer>
void adam_like_step(Optimizer& optimizer, bool decoupled, const char* who) {
  ::torch::NoGradGuard no_grad;
  for (auto& group : optimizer.param_groups()) {
    const auto& o = static_cast<const Options&>(group.options());
    const double b1 = std::get<0>(o.betas()), b2 = std::get<1>(o.betas());
    if (!(b1 >= 0 && b1 < 1 && b2 >= 0 && b2 < 1) || !(o.eps() >= 0))
      throw InvalidArgument(fmt::format("{}: betas must be in [0, 1) and eps >= 0 (got betas ({}, {}), eps {}); fix the "
                                        "optimizer's options",
                                        who, b1, b2, o.eps()));
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const ::torch::Tensor& g = p.grad();
      if (g.is_sparse())
        throw InvalidArgument(fmt::format("{}: a parameter has a sparse gradient; Adam does not take those (LibTorch's "
                                          "step() refuses them too)",
                                          who));
      State& s = adam_state<State>(optimizer, p, o.amsgrad());
      s.step(s.step() + 1);
      const double bc1 = 1 - std::pow(b1, static_cast<double>(s.step()));
      const double bc2 = 1 - std::pow(b2, static_cast<double>(s.step()));
      const int64_t n = p.numel();
      const bool fusable = is_plain_float(p, n) && is_plain_float(g, n) && is_plain_float(s.exp_avg(), n) &&
                           is_plain_float(s.exp_avg_sq(), n) && (!o.amsgrad() || is_plain_float(s.max_exp_avg_sq(), n));
      if (!fusable) {
        adam_unfused(p, g, s, o, decoupled, bc1, bc2);
        continue;
      }
      const bool decay = o.weight_decay() != 0;
      const AdamConsts c{static_cast<float>(b1),
                         static_cast<float>(1 - b1),
                         static_cast<float>(b2),
                         static_cast<float>(1 - b2),
                         static_cast<float>(std::sqrt(bc2)),
                         static_cast<float>(o.eps()),
                         static_cast<float>(-o.lr() / bc1),
                         decay && !decoupled ? static_cast<float>(o.weight_decay()) : 0.0f,
                         decay && decoupled ? static_cast<float>(1 - o.lr() * o.weight_decay()) : 1.0f,
                         o.amsgrad()};
      adam_fused(p.template data_ptr<float>(), g.template data_ptr<float>(), s.exp_avg().template data_ptr<float>(),
                 s.exp_avg_sq().template data_ptr<float>(),
                 o.amsgrad() ? s.max_exp_avg_sq().template data_ptr<float>() : nullptr, n, c);
    }
  }
}

}  // namespace

void adam_step(::torch::optim::Adam& optimizer) {
  adam_like_step<::torch::optim::AdamOptions, ::torch::optim::AdamParamState>(optimizer, false, "adam_step");
}

void adamw_step(::torch::optim::AdamW& optimizer) {
  adam_like_step<::torch::optim::AdamWOptions, ::torch::optim::AdamWParamState>(optimizer, true, "adamw_step");
}

}  // namespace cohort::torch
