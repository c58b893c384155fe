// recompute(): the autograd node that runs a function again in backward
// (include/cohort/torch_recompute.hpp has the user's view).
//
// Forward runs fn(x) under no-grad, so no intermediate tensor is kept, and
// makes a RecomputeBackward node the output's grad_fn, with x's edge as its
// next. Its apply() runs fn again on a detached copy of x with grad mode on,
// then a nested backward through that graph with the incoming gradient: the
// parameters inside fn accumulate their gradients (their hooks fire as usual)
// and x's gradient is returned to the outer pass. This is the "reentrant"
// form of PyTorch's torch.utils.checkpoint; the other form needs
// saved-tensor hooks, which LibTorch 1.13 offers to Python only.
//
// Reentrancy has one trap: a callback queued with Engine::queue_callback
// inside the nested pass runs when that pass ends. DDP queues its finalize()
// when the first gradient arrives; if that gradient comes from inside fn,
// finalize would run before the rest of the model has its gradients. So DDP
// and FSDP queue through queue_backward_callback(): inside a nested pass it
// collects the callbacks, and apply() queues them again on the enclosing
// pass once the nested one has returned.
#include "cohort/torch_recompute.hpp"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <fmt/format.h>

#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#include "autocast_state.hpp"
#include "backward_callback.hpp"
#include "cohort/error.hpp"

namespace cohort::torch {
namespace {

using ::torch::Tensor;
using ::torch::autograd::variable_list;

thread_local std::vector<std::function<void()>>* t_deferred = nullptr;  // the innermost nested pass's callbacks
thread_local int t_running = 0;                                         // recompute functions running on this thread

// Sets a thread-local for a scope and puts the old value back, also on an exception.
template <class T>
class Swap {
 public:
  Swap(T& slot, T value) : slot_(slot), old_(std::exchange(slot, std::move(value))) {}
  ~Swap() { slot_ = std::move(old_); }
  Swap(const Swap&) = delete;
  Swap& operator=(const Swap&) = delete;

 private:
  T& slot_;
  T old_;
};

using GeneratorStates = std::vector<std::pair<at::Generator, Tensor>>;

// How the autograd graph holds its nodes: std::shared_ptr in LibTorch 1.x,
// c10::intrusive_ptr in 2.x (Node derives from intrusive_ptr_target there).
using NodePtr = std::decay_t<decltype(std::declval<const Tensor&>().grad_fn())>;
template <class T, class... Args>
NodePtr make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<::torch::autograd::Node>>)
    return std::make_shared<T>(std::forward<Args>(args)...);
  else
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
}

// Autocast as the first run had it, for the CPU and CUDA, so that the second
// run computes in the same dtypes (backward runs outside the user's
// Autocast scope, as in PyTorch).
struct AutocastState {
  bool on[2] = {false, false};
  ::torch::ScalarType dtype[2] = {::torch::kBFloat16, ::torch::kHalf};
  static constexpr c10::DeviceType kDevices[2] = {c10::DeviceType::CPU, c10::DeviceType::CUDA};
  static AutocastState now() {
    AutocastState s;
    for (int d = 0; d < 2; ++d) {
      s.on[d] = detail::autocast_on(kDevices[d]);
      s.dtype[d] = detail::autocast_dtype(kDevices[d]);
    }
    return s;
  }
};

// Sets an autocast state for a scope, then puts back the one before. Like
// Autocast, it counts as a nesting level, so that the casts of the weights
// cached during the scope are dropped when the outermost level ends (else
// the next step's forward would reuse casts made before the optimizer step).
class AutocastScope {
 public:
  explicit AutocastScope(const AutocastState& s) : before_(AutocastState::now()) {
    set(s);
    at::autocast::increment_nesting();
  }
  ~AutocastScope() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    set(before_);
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  static void set(const AutocastState& s) {
    for (int d = 0; d < 2; ++d) detail::set_autocast(AutocastState::kDevices[d], s.on[d], s.dtype[d]);
  }
  AutocastState before_;
};

GeneratorStates states_of(std::vector<at::Generator> generators) {
  GeneratorStates out;
  for (auto& g : generators) {
    std::lock_guard<std::mutex> lock(g.mutex());
    out.emplace_back(g, g.get_state());
  }
  return out;
}

void set_states(const GeneratorStates& states) {
  for (auto [g, state] : states) {
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_state(state);
  }
}

class RecomputeBackward final : public ::torch::autograd::Node {
 public:
  RecomputeBackward(RecomputeFn fn, const Tensor& x, GeneratorStates rng, AutocastState autocast)
      : fn_(std::move(fn)),
        input_(x.detach()),
        version_(x._version()),
        input_grad_(x.requires_grad()),
        rng_(std::move(rng)),
        autocast_(autocast) {}

  std::string name() const override { return "cohort::torch::RecomputeBackward"; }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (::torch::GradMode::is_enabled())
      throw Error("recompute: backward with create_graph (a gradient of a gradient) is not supported: the nested "
                  "backward that recompute() runs builds no graph, so the higher-order terms would be lost. HINT: "
                  "do not recompute what is differentiated twice");
    if (!fn_)
      throw Error("recompute: a second backward through the same recompute() call (retain_graph, or autograd::grad "
                  "then backward); its function is run again once, in the first. HINT: call recompute() again for "
                  "each backward, or do not recompute what is differentiated twice");
    const RecomputeFn fn = std::exchange(fn_, nullptr);
    const Tensor input = std::exchange(input_, Tensor());
    if (input._version() != version_)
      throw Error("recompute: its input was changed in place after the forward pass, so running the function again "
                  "would not give the same result. HINT: do not modify the input in place (x.add_(...)); use x + ...");
    if (grads.empty() || !grads[0].defined()) return {Tensor()};
    Tensor x = input.detach().requires_grad_(input_grad_);
    std::vector<std::function<void()>> deferred;
    {
      const GeneratorStates now = states_of(generators());
      set_states(rng_);
      Tensor out;
      {
        Swap<int> running(t_running, t_running + 1);
        ::torch::AutoGradMode grad_mode(true);
        AutocastScope autocast(autocast_);
        try {
          out = fn(x);
        } catch (...) {
          set_states(now);
          throw;
        }
      }
      set_states(now);  // backward draws nothing: the generators continue as if nothing ran
      Swap<std::vector<std::function<void()>>*> collect(t_deferred, &deferred);
      if (out.requires_grad()) ::torch::autograd::backward({out}, {grads[0]});
    }
    for (auto& callback : deferred) detail::queue_backward_callback(std::move(callback));
    return {input_grad_ ? x.grad() : Tensor()};
  }

 protected:
  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    fn_ = nullptr;
    input_ = Tensor();
  }

 private:
  std::vector<at::Generator> generators() const {
    std::vector<at::Generator> out;
    for (const auto& [g, state] : rng_) out.push_back(g);
    return out;
  }

  RecomputeFn fn_;
  Tensor input_;  // detached: shares x's data and version counter, not its graph
  uint32_t version_;
  bool input_grad_;
  GeneratorStates rng_;  // before the first run
  AutocastState autocast_;  // during the first run
};

}  // namespace

namespace detail {

void queue_backward_callback(std::function<void()> callback) {
  if (t_deferred) t_deferred->push_back(std::move(callback));
  else ::torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
}

bool in_recompute() { return t_running > 0; }

}  // namespace detail

Tensor recompute(RecomputeFn fn, const Tensor& x, std::vector<at::Generator> generators) {
  if (!fn) throw InvalidArgument("recompute: the function is empty");
  if (!x.defined()) throw InvalidArgument("recompute: the input tensor is undefined");
  if (!::torch::GradMode::is_enabled()) return fn(x);  // no graph: nothing to recompute
  generators.push_back(at::globalContext().defaultGenerator(x.device()));
  std::vector<at::Generator> unique;
  for (const auto& g : generators) {
    if (!g.defined()) throw InvalidArgument("recompute: a generator in `generators` is undefined");
    bool seen = false;
    for (const auto& u : unique) seen = seen || u == g;
    if (!seen) unique.push_back(g);
  }
  GeneratorStates rng = states_of(unique);
  const AutocastState autocast = AutocastState::now();
  Tensor out;
  {
    Swap<int> running(t_running, t_running + 1);
    ::torch::NoGradGuard no_grad;
    // Autocast caches the cast of each weight for its scope; a cast made
    // here, without a gradient history, would be reused by the weight's
    // next use with gradients in the same scope (LibTorch 1.13), which would
    // then get no gradient.
    const bool cache = at::autocast::is_autocast_cache_enabled();
    at::autocast::set_autocast_cache_enabled(false);
    try {
      out = fn(x);
    } catch (...) {
      at::autocast::set_autocast_cache_enabled(cache);
      throw;
    }
    at::autocast::set_autocast_cache_enabled(cache);
    if (!out.defined()) throw InvalidArgument("recompute: the function returned an undefined tensor");
    if (!at::isFloatingType(out.scalar_type()) && !at::isComplexType(out.scalar_type()))
      throw InvalidArgument(fmt::format("recompute: the function returned a {} tensor; only a floating-point result "
                                        "carries gradients. HINT: recompute the part that computes in floating point",
                                        c10::toString(out.scalar_type())));
    // The node becomes the output's grad_fn: the output must be a tensor of
    // its own, not x, a view, or a tensor fn returned from elsewhere (a
    // parameter, a buffer: someone else holds it).
    if (out.is_alias_of(x) || out.is_view() || out.requires_grad() || out.use_count() > 1) out = out.clone();
  }
  NodePtr node = make_node<RecomputeBackward>(std::move(fn), x, std::move(rng), autocast);
  node->set_next_edges(::torch::autograd::collect_next_edges(x));
  ::torch::autograd::set_history(out, node);
  return out;
}

}  // namespace cohort::torch
