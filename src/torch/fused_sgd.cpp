// sgd_step: torch::optim::SGD's update in one pass over each parameter.
//
// LibTorch's SGD::step() runs one tensor operation at a time: with momentum
// and weight decay that is five passes over memory per parameter (d_p = g +
// wd p; buf *= m; buf += (1 - damp) d_p; p -= lr buf), each reading and
// writing whole tensors. For a 10 M-parameter model that is ~320 MB of memory
// traffic per step, and when the ranks of a DDP job all step at the same
// moment (they leave the last allreduce together) they compete for the
// memory bus and the step takes twice as long (docs/performance-history.md). Here
// every element is loaded once, updated in registers and stored once: ~200 MB.
//
// The arithmetic follows LibTorch's order (the same multiplies and fused
// multiply-adds), so results agree with SGD::step() to the last bit or
// within one rounding; the state (momentum buffers) stays in the optimizer,
// so checkpoints (optimizer_state) and SGD::step() itself keep working on it.
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

struct SgdConsts {
  float lr, momentum, keep, weight_decay;  // keep = 1 - dampening
  bool nesterov;
};

// One element; the vector loop below does the same per lane. `first`: the
// parameter has no momentum buffer yet (LibTorch: buf = clone(d_p)).
inline void sgd_scalar(float* p, const float* g, float* buf, int64_t i, const SgdConsts& c, bool first) {
  float d = g[i];
  if (c.weight_decay != 0.0f) d = std::fma(p[i], c.weight_decay, d);
  if (c.momentum != 0.0f) {
    float b = first ? d : std::fma(d, c.keep, buf[i] * c.momentum);
    buf[i] = b;
    d = c.nesterov ? std::fma(b, c.momentum, d) : b;
  }
  p[i] = std::fma(d, -c.lr, p[i]);
}

void sgd_portable(float* p, const float* g, float* buf, int64_t n, const SgdConsts& c, bool first) {
  for (int64_t i = 0; i < n; ++i) sgd_scalar(p, g, buf, i, c, first);
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) void sgd_avx2(float* p, const float* g, float* buf, int64_t n, const SgdConsts& c,
                                                  bool first) {
  const __m256 wd = _mm256_set1_ps(c.weight_decay), m = _mm256_set1_ps(c.momentum);
  const __m256 keep = _mm256_set1_ps(c.keep), neg_lr = _mm256_set1_ps(-c.lr);
  const bool decay = c.weight_decay != 0.0f, mom = c.momentum != 0.0f;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 pv = _mm256_loadu_ps(p + i);
    __m256 d = _mm256_loadu_ps(g + i);
    if (decay) d = _mm256_fmadd_ps(pv, wd, d);
    if (mom) {
      __m256 b = first ? d : _mm256_fmadd_ps(d, keep, _mm256_mul_ps(_mm256_loadu_ps(buf + i), m));
      _mm256_storeu_ps(buf + i, b);
      d = c.nesterov ? _mm256_fmadd_ps(b, m, d) : b;
    }
    _mm256_storeu_ps(p + i, _mm256_fmadd_ps(d, neg_lr, pv));
  }
  for (; i < n; ++i) sgd_scalar(p, g, buf, i, c, first);
}
#endif

void sgd_fused(float* p, const float* g, float* buf, int64_t n, const SgdConsts& c, bool first) {
#if defined(__x86_64__)
  if (have_avx2_fma()) return sgd_avx2(p, g, buf, n, c, first);
#endif
  sgd_portable(p, g, buf, n, c, first);
}

// What the fused loop handles: dense, contiguous float32 on the CPU, and a
// momentum buffer (if any) of the same kind. Anything else takes LibTorch's
// own operations, in SGD::step()'s order.
bool fusable(const ::torch::Tensor& p, const ::torch::Tensor& g, const ::torch::Tensor& buf) {
  const int64_t n = p.numel();
  return is_plain_float(p, n) && is_plain_float(g, n) && (!buf.defined() || is_plain_float(buf, n));
}

// `buf`: the momentum buffer (undefined before the first step, or without momentum).
void sgd_unfused(::torch::Tensor& p, const ::torch::Tensor& grad, ::torch::Tensor& buf, const ::torch::optim::SGDOptions& o) {
  auto d_p = grad;
  if (o.weight_decay() != 0) d_p = d_p.add(p, o.weight_decay());
  if (o.momentum() != 0) {
    if (!buf.defined())
      buf = ::torch::clone(d_p).detach();
    else
      buf.mul_(o.momentum()).add_(d_p, 1 - o.dampening());
    d_p = o.nesterov() ? d_p.add(buf, o.momentum()) : buf;
  }
  p.add_(d_p, -o.lr());
}

// The parameter's state in the optimizer, made if it has none (only with
// momentum: SGD keeps no state otherwise).
::torch::optim::SGDParamState& momentum_state(::torch::optim::SGD& optimizer, const ::torch::Tensor& p) {
  auto& slot = optimizer.state()[state_key(p)];
  if (!slot) slot = std::make_unique<::torch::optim::SGDParamState>();
  return static_cast<::torch::optim::SGDParamState&>(*slot);
}

}  // namespace

void sgd_step(::torch::optim::SGD& optimizer) {
  ::torch::NoGradGuard no_grad;
  for (auto& group : optimizer.param_groups()) {
    const auto& o = static_cast<const ::torch::optim::SGDOptions&>(group.options());
    if (o.nesterov() && (o.momentum() <= 0 || o.dampening() != 0))
      throw InvalidArgument(fmt::format("sgd_step: Nesterov momentum needs momentum > 0 and dampening 0 (got momentum "
                                        "{}, dampening {}); fix the SGDOptions",
                                        o.momentum(), o.dampening()));
    const SgdConsts c{static_cast<float>(o.lr()), static_cast<float>(o.momentum()), static_cast<float>(1.0 - o.dampening()),
                      static_cast<float>(o.weight_decay()), o.nesterov()};
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const ::torch::Tensor& g = p.grad();
      if (g.is_sparse())
        throw InvalidArgument("sgd_step: a parameter has a sparse gradient; use the optimizer's own step() for those");
      ::torch::optim::SGDParamState* state = o.momentum() != 0 ? &momentum_state(optimizer, p) : nullptr;
      ::torch::Tensor buf = state != nullptr ? state->momentum_buffer() : ::torch::Tensor();
      const bool first = state != nullptr && !buf.defined();
      if (!fusable(p, g, buf)) {
        sgd_unfused(p, g, buf, o);
      } else {
        if (first) buf = ::torch::empty_like(p, ::torch::MemoryFormat::Contiguous);  // the loop writes d_p into it
        sgd_fused(p.data_ptr<float>(), g.data_ptr<float>(), buf.defined() ? buf.data_ptr<float>() : nullptr, p.numel(), c,
                  first);
      }
      if (first) state->momentum_buffer(buf);
    }
  }
}

}  // namespace cohort::torch
