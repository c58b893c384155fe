// Modules and optimizers <-> named tensors for checkpoints (safetensors).
#include <cstdio>
#include <cstring>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cohort/torch.hpp"
#include "cohort/torch_train.hpp"
#include "device.hpp"
#include "state_key.hpp"

namespace cohort::torch {
namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

void copy_into(::torch::Tensor& dst, const NamedTensor& src, const std::string& what) {
  auto t = from_named(src);
  if (t.sizes() != dst.sizes())
    throw InvalidArgument(fmt::format("checkpoint tensor '{}' has shape {} but {} has {}", src.name, shape_str(src.shape), what,
                                      shape_str(dst.sizes().vec())));
  ::torch::NoGradGuard no_grad;
  dst.copy_(t);
}

// Adam's and AdamW's state have the same fields (LibTorch gives them two types).
template <class State>
void save_adam_state(const State& s, const std::string& pre, std::vector<NamedTensor>& out) {
  out.push_back(to_named(pre + "step", ::torch::tensor(s.step(), ::torch::kLong)));
  out.push_back(to_named(pre + "exp_avg", s.exp_avg()));
  out.push_back(to_named(pre + "exp_avg_sq", s.exp_avg_sq()));
  if (s.max_exp_avg_sq().defined()) out.push_back(to_named(pre + "max_exp_avg_sq", s.max_exp_avg_sq()));  // amsgrad
}

template <class State>
std::unique_ptr<State> load_adam_state(const std::map<std::string, const NamedTensor*>& by_name, const std::string& pre,
                                       const NamedTensor& step, const ::torch::Device& device) {
  auto need = [&](const char* field) -> const NamedTensor& {
    auto it = by_name.find(pre + field);
    if (it == by_name.end())
      throw InvalidArgument(fmt::format("load_optimizer_state: the checkpoint has {}step but no {}{}: it is not an Adam "
                                        "state this version wrote, or it is damaged",
                                        pre, pre, field));
    return *it->second;
  };
  auto s = std::make_unique<State>();
  s->step(from_named(step).item<int64_t>());
  // The moments live where the parameter does (a checkpoint saved from a GPU loads on a CPU and back).
  s->exp_avg(from_named(need("exp_avg")).to(device));
  s->exp_avg_sq(from_named(need("exp_avg_sq")).to(device));
  if (auto it = by_name.find(pre + "max_exp_avg_sq"); it != by_name.end())
    s->max_exp_avg_sq(from_named(*it->second).to(device));
  return s;
}

// "sgd" or "adam" from the names of a saved state's tensors ("" when it has
// no per-parameter state: nothing to mismatch).
std::string saved_kind(const std::vector<NamedTensor>& tensors) {
  for (const auto& t : tensors) {
    if (t.name.ends_with(".momentum_buffer")) return "sgd";
    if (t.name.ends_with(".exp_avg")) return "adam";
  }
  return "";
}

}  // namespace

NamedTensor to_named(const std::string& name, const ::torch::Tensor& t) {
  if (t.numel() > 0 && t.has_storage() && t.storage().nbytes() == 0)
    throw InvalidArgument(fmt::format("'{}' has no data: a parameter FullyShardedDataParallel keeps sharded (it exists "
                                      "whole only while its unit computes). HINT: save fsdp.full_state() or "
                                      "fsdp.state_shard(), not the module's own state",
                                      name));
  auto c = t.detach().contiguous().cpu();
  NamedTensor n{name, to_dtype(c.scalar_type()), c.sizes().vec(), {}};
  const auto* p = static_cast<const uint8_t*>(c.data_ptr());
  n.bytes.assign(p, p + c.numel() * c.element_size());
  return n;
}

::torch::Tensor from_named(const NamedTensor& n) {
  auto t = ::torch::empty(n.shape, ::torch::TensorOptions().dtype(to_scalar_type(n.dtype)));
  if (n.bytes.size() != static_cast<size_t>(t.numel() * t.element_size()))
    throw InvalidArgument(fmt::format("checkpoint tensor '{}' has {} bytes for shape {}", n.name, n.bytes.size(), shape_str(n.shape)));
  if (!n.bytes.empty()) std::memcpy(t.data_ptr(), n.bytes.data(), n.bytes.size());
  return t;
}

std::vector<NamedTensor> module_state(const ::torch::nn::Module& module) {
  std::vector<NamedTensor> out;
  for (const auto& p : module.named_parameters(true)) out.push_back(to_named(p.key(), p.value()));
  for (const auto& b : module.named_buffers(true)) out.push_back(to_named(b.key(), b.value()));
  return out;
}

void load_module_state(::torch::nn::Module& module, const std::vector<NamedTensor>& tensors) {
  std::map<std::string, const NamedTensor*> by_name;
  for (const auto& t : tensors) by_name[t.name] = &t;
  size_t used = 0;
  auto load = [&](const std::string& name, ::torch::Tensor t, const char* kind) {
    auto it = by_name.find(name);
    if (it == by_name.end())
      throw InvalidArgument(fmt::format("the checkpoint has no tensor for {} '{}'; was it saved from another model?", kind, name));
    copy_into(t, *it->second, fmt::format("the model's {} '{}'", kind, name));
    ++used;
  };
  for (auto& p : module.named_parameters(true)) load(p.key(), p.value(), "parameter");
  for (auto& b : module.named_buffers(true)) load(b.key(), b.value(), "buffer");
  if (used != by_name.size()) {
    std::string extra;
    for (auto& [name, t] : by_name)
      if (module.named_parameters(true).find(name) == nullptr && module.named_buffers(true).find(name) == nullptr)
        extra += (extra.empty() ? "" : ", ") + name;
    throw InvalidArgument(fmt::format("the checkpoint has tensors the model does not: {}", extra));
  }
}

std::vector<NamedTensor> optimizer_state(::torch::optim::Optimizer& optimizer) {
  std::vector<NamedTensor> out;
  auto& state = optimizer.state();
  auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    out.push_back(to_named(fmt::format("group{}.lr", g), ::torch::tensor(groups[g].options().get_lr(), ::torch::kDouble)));
    auto& params = groups[g].params();
    for (size_t k = 0; k < params.size(); ++k) {
      auto it = state.find(state_key(params[k]));
      if (it == state.end()) continue;
      std::string pre = fmt::format("group{}.param{}.", g, k);
      if (auto* s = dynamic_cast<::torch::optim::SGDParamState*>(it->second.get())) {
        if (s->momentum_buffer().defined()) out.push_back(to_named(pre + "momentum_buffer", s->momentum_buffer()));
      } else if (auto* a = dynamic_cast<::torch::optim::AdamParamState*>(it->second.get())) {
        save_adam_state(*a, pre, out);
      } else if (auto* w = dynamic_cast<::torch::optim::AdamWParamState*>(it->second.get())) {
        save_adam_state(*w, pre, out);
      } else {
        throw InvalidArgument("optimizer_state: only SGD, Adam and AdamW state can be saved so far");
      }
    }
  }
  return out;
}

namespace {
// State is saved by position (group<g>.param<k>.<field>): a checkpoint of
// another model or another parameter grouping would otherwise hand one
// parameter's moments to another. Every per-parameter tensor must name a
// parameter the optimizer has and (except the step count) have its shape.
void check_state_fits(const std::vector<NamedTensor>& tensors, const std::vector<::torch::optim::OptimizerParamGroup>& groups) {
  for (const NamedTensor& t : tensors) {
    size_t g = 0, k = 0;
    int used = 0;
    if (std::sscanf(t.name.c_str(), "group%zu.param%zu.%n", &g, &k, &used) != 2 || used == 0) continue;
    const std::string field = t.name.substr(static_cast<size_t>(used));
    if (g >= groups.size() || k >= groups[g].params().size())
      throw InvalidArgument(fmt::format("load_optimizer_state: the saved state has '{}', but the optimizer has {} "
                                        "group(s){}; was the checkpoint made for another model or parameter grouping?",
                                        t.name, groups.size(),
                                        g < groups.size() ? fmt::format(" and group {} has {} parameter(s)", g,
                                                                        groups[g].params().size())
                                                          : std::string()));
    if (field == "step") continue;
    const auto want = groups[g].params()[k].sizes().vec();
    if (t.shape != want)
      throw InvalidArgument(fmt::format("load_optimizer_state: '{}' has shape [{}] but parameter {} of group {} has "
                                        "[{}]; was the checkpoint made for another model?",
                                        t.name, fmt::join(t.shape, ", "), k, g, fmt::join(want, ", ")));
  }
}
}  // namespace

void load_optimizer_state(::torch::optim::Optimizer& optimizer, const std::vector<NamedTensor>& tensors) {
  std::map<std::string, const NamedTensor*> by_name;
  for (const auto& t : tensors) by_name[t.name] = &t;
  auto& state = optimizer.state();
  auto& groups = optimizer.param_groups();
  bool is_sgd = dynamic_cast<::torch::optim::SGD*>(&optimizer) != nullptr;
  bool is_adamw = dynamic_cast<::torch::optim::AdamW*>(&optimizer) != nullptr;
  if (!is_sgd && !is_adamw && dynamic_cast<::torch::optim::Adam*>(&optimizer) == nullptr)
    throw InvalidArgument("load_optimizer_state: only SGD, Adam and AdamW state can be loaded so far");
  const std::string kind = saved_kind(tensors);
  if (!kind.empty() && kind != (is_sgd ? "sgd" : "adam"))
    throw InvalidArgument(fmt::format("load_optimizer_state: the saved state is {}'s ({}) but the optimizer is {}; "
                                      "resume with the optimizer the checkpoint was made with",
                                      kind == "sgd" ? "SGD" : "Adam/AdamW",
                                      kind == "sgd" ? "momentum buffers" : "moments and step counts",
                                      is_sgd ? "SGD" : (is_adamw ? "AdamW" : "Adam")));
  check_state_fits(tensors, groups);
  for (size_t g = 0; g < groups.size(); ++g) {
    if (auto it = by_name.find(fmt::format("group{}.lr", g)); it != by_name.end())
      groups[g].options().set_lr(from_named(*it->second).item<double>());
    auto& params = groups[g].params();
    for (size_t k = 0; k < params.size(); ++k) {
      std::string pre = fmt::format("group{}.param{}.", g, k);
      if (is_sgd) {
        auto it = by_name.find(pre + "momentum_buffer");
        if (it == by_name.end()) continue;
        auto s = std::make_unique<::torch::optim::SGDParamState>();
        s->momentum_buffer(from_named(*it->second).to(params[k].device()));
        state[state_key(params[k])] = std::move(s);
      } else {
        auto st = by_name.find(pre + "step");
        if (st == by_name.end()) continue;
        if (is_adamw)
          state[state_key(params[k])] = load_adam_state<::torch::optim::AdamWParamState>(by_name, pre, *st->second,
                                                                                        params[k].device());
        else
          state[state_key(params[k])] = load_adam_state<::torch::optim::AdamParamState>(by_name, pre, *st->second,
                                                                                       params[k].device());
      }
    }
  }
}

std::string cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  auto t = gen.get_state();
  return std::string(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel()));
}

void set_cpu_rng_state(const std::string& bytes) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  auto t = ::torch::empty({static_cast<int64_t>(bytes.size())}, ::torch::kByte);
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  gen.set_state(t);
}

size_t optimizer_state_bytes(::torch::optim::Optimizer& optimizer) {
  size_t bytes = 0;
  const auto add = [&](const ::torch::Tensor& t) {
    if (t.defined()) bytes += t.nbytes();
  };
  for (const auto& [key, s] : optimizer.state()) {
    (void)key;
    if (auto* a = dynamic_cast<::torch::optim::AdamParamState*>(s.get())) {
      add(a->exp_avg());
      add(a->exp_avg_sq());
      add(a->max_exp_avg_sq());
    } else if (auto* w = dynamic_cast<::torch::optim::AdamWParamState*>(s.get())) {
      add(w->exp_avg());
      add(w->exp_avg_sq());
      add(w->max_exp_avg_sq());
    } else if (auto* g = dynamic_cast<::torch::optim::SGDParamState*>(s.get())) {
      add(g->momentum_buffer());
    }
  }
  return bytes;
}

}  // namespace cohort::torch
