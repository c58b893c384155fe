// cohort/torch_train.hpp: training helpers for LibTorch programs: a dynamic
// loss scaler, global-norm clipping, the learning-rate schedule, and
// checkpoint conversion of modules and optimizers.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "cohort/checkpoint.hpp"
#include "cohort/process_group.hpp"
#include "cohort/export.hpp"

namespace cohort::torch {

// Dynamic loss scaling with torch.cuda.amp.GradScaler's semantics, for fp16
// training: the loss is multiplied by scale() before backward; step() unscales
// the gradients, and if any rank found an inf/NaN the optimizer step is skipped
// on every rank and the scale backs off (x backoff_factor); after
// growth_interval clean steps it grows (x growth_factor). Per step:
//
//   scaler.scale(loss).backward();
//   scaler.unscale(opt, pg.get());                 // only to look at true gradients:
//   cohort::torch::clip_grad_norm(params, 1.0);    //   clipping, logging the norm
//   scaler.step(opt, pg.get());                    // steps, or skips on inf/NaN; updates the scale
//
// The scale and the growth tracker belong in checkpoints (current_scale(),
// growth_tracker(), load()) for an exact resume.
struct COHORT_API GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int growth_interval = 2000;
  bool enabled = true;
};

class COHORT_API GradScaler {
 public:
  // Throws InvalidArgument for a scale or factor that cannot work (init_scale
  // <= 0, growth_factor <= 1, backoff_factor outside (0, 1), growth_interval < 1).
  explicit GradScaler(GradScalerOptions o = {});
  // loss x scale. Throws InvalidArgument if unscale() ran without the step() that must follow it.
  ::torch::Tensor scale(const ::torch::Tensor& loss) const;
  // Divides the gradients of `optimizer` by the scale and checks them for
  // inf/NaN on every rank of `group` (nullptr: this process only), once per
  // step: a second call before step() throws InvalidArgument (the gradients
  // would be divided twice). Returns whether every gradient was finite; call
  // step() after it either way (it skips the optimizer and backs off the scale).
  bool unscale(::torch::optim::Optimizer& optimizer, ProcessGroup* group);
  // unscale() unless already called this step, then steps if every gradient
  // was finite on every rank, and updates the scale. Returns whether the
  // optimizer stepped. Every rank takes the same decision.
  bool step(::torch::optim::Optimizer& optimizer, ProcessGroup* group);
  double current_scale() const { return scale_; }
  int64_t skipped_steps() const { return skipped_; }
  void load(double scale, int growth_tracker) { scale_ = scale; tracker_ = growth_tracker; }
  int growth_tracker() const { return tracker_; }

 private:
  GradScalerOptions o_;
  double scale_;
  int tracker_ = 0;
  int64_t skipped_ = 0;
  bool unscaled_ = false;  // unscale() ran since the last step()
  bool found_inf_ = false;
};

// bf16 autocast for a forward pass on the CPU, as a scope: inside it LibTorch
// runs matmuls and convolutions in bfloat16 (its CPU autocast list) while
// keeping precision-sensitive operations in float32. Leaving the scope, also
// by an exception, restores the previous autocast state and clears the cast
// cache of the outermost scope. Run backward outside it, as in PyTorch:
//
//   torch::Tensor loss;
//   { cohort::torch::Autocast autocast; loss = loss_fn(model->forward(x).to(torch::kFloat), y); }
//   loss.backward();
//
// On a CUDA GPU (device = c10::DeviceType::CUDA) the dtype is float16 (with a
// GradScaler) or bfloat16. LibTorch's CPU autocast takes bfloat16 only:
// another dtype throws InvalidArgument.
class COHORT_API Autocast {
 public:
  explicit Autocast(::torch::ScalarType dtype = ::torch::kBFloat16, bool enabled = true,
                    c10::DeviceType device = c10::DeviceType::CPU);
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  c10::DeviceType device_;
  bool prev_enabled_;
  ::torch::ScalarType prev_dtype_;
};

// Whether autocast is on for `device` on this thread (LibTorch 1.x and 2.x alike).
COHORT_API bool autocast_enabled(c10::DeviceType device);

// Clears the gradients before the next backward. set_to_none (PyTorch's
// default since 2.0; LibTorch 1.13's Optimizer::zero_grad() only zeroes in
// place) drops them instead of writing zeros: backward then hands over its
// fresh gradient instead of adding it to zeros. With DDP's
// gradient_as_bucket_view that saves two passes over the gradients per step
// (the zeroing, and reading the zeros back), and DDP copies the fresh gradient
// into its bucket once; .grad is a view of the bucket again after backward.
COHORT_API void zero_grad(::torch::optim::Optimizer& optimizer, bool set_to_none = true);

// optimizer.step() for torch::optim::SGD, in one pass over each parameter:
// the same update (momentum, dampening, Nesterov, weight decay, every param
// group's options) and the same state (momentum buffers in optimizer.state(),
// so optimizer_state() and checkpoints are unchanged), for about 40% less
// memory traffic than LibTorch's five tensor operations per parameter. Dense
// contiguous float32 CPU parameters take the fused loop (AVX2 where the CPU
// has it); others take LibTorch's operations. Results match step() within one
// rounding per operation. Throws InvalidArgument for a sparse gradient.
COHORT_API void sgd_step(::torch::optim::SGD& optimizer);

// optimizer.step() for torch::optim::Adam and AdamW, in one pass over each
// parameter: the same update (betas, eps, weight decay as L2 for Adam and
// decoupled for AdamW, amsgrad, bias correction, every param group's options)
// and the same state (step, exp_avg, exp_avg_sq, max_exp_avg_sq in
// optimizer.state()), reading and writing the parameter, gradient and moments
// once each: ~7 passes over the parameter's size against LibTorch's ~20.
// Dense contiguous float32 CPU tensors take the fused loop (AVX2 where the CPU
// has it); others take LibTorch's operations. Results match step() within a
// rounding or two per operation. Throws InvalidArgument for a sparse gradient
// or betas outside [0, 1).
COHORT_API void adam_step(::torch::optim::Adam& optimizer);
COHORT_API void adamw_step(::torch::optim::AdamW& optimizer);

// Clips the gradients of `params` to a global L2 norm of max_norm; returns the
// norm before clipping. (After DDP's finalize every rank holds the same
// averaged gradients, so the norm is already global across ranks.)
COHORT_API double clip_grad_norm(const std::vector<::torch::Tensor>& params, double max_norm);

// Linear warmup from 0 to peak over warmup_steps, then cosine decay to
// final_fraction * peak at total_steps. Pure: lr at a step.
COHORT_API double warmup_cosine_lr(int64_t step, int64_t warmup_steps, int64_t total_steps, double peak, double final_fraction = 0.0);

// Linear scaling rule (Goyal et al., 2017): base_lr x world size.
inline double scaled_lr(double base_lr, int world_size) { return base_lr * world_size; }

// Module parameters and buffers as named tensors ("conv1.weight", ...), and back.
// load_module_state throws InvalidArgument naming a missing, unexpected or
// mis-shaped tensor.
COHORT_API std::vector<NamedTensor> module_state(const ::torch::nn::Module& module);
COHORT_API void load_module_state(::torch::nn::Module& module, const std::vector<NamedTensor>& tensors);

// SGD (momentum buffers) and Adam/AdamW (exp_avg, exp_avg_sq, step) state, plus
// each group's lr, named "group<g>.param<k>.<field>" by position.
COHORT_API std::vector<NamedTensor> optimizer_state(::torch::optim::Optimizer& optimizer);
COHORT_API void load_optimizer_state(::torch::optim::Optimizer& optimizer, const std::vector<NamedTensor>& tensors);

// Bytes of the optimizer's per-parameter state tensors (SGD's momentum
// buffers; Adam's and AdamW's moments, and max_exp_avg_sq with amsgrad):
// what sharding the optimizer divides. 0 before the first step.
COHORT_API size_t optimizer_state_bytes(::torch::optim::Optimizer& optimizer);

COHORT_API NamedTensor to_named(const std::string& name, const ::torch::Tensor& t);
COHORT_API ::torch::Tensor from_named(const NamedTensor& t);

// The default CPU generator's state as bytes, and back (for the manifest).
COHORT_API std::string cpu_rng_state();
COHORT_API void set_cpu_rng_state(const std::string& bytes);

}  // namespace cohort::torch
