// Modules and optimizers <-> named tensors for checkpoints (safetensors).
#include <cstring>
#include <map>

#include <fmt/format.h>

#include "cohort/torch.hpp"
#include "cohort/torch_train.hpp"
#include "state_key.hpp"

namespace cohort::torch {
namespace {

::torch::ScalarType to_scalar(DType t) {
  switch (t) {
    case DType::F32: return ::torch::kFloat;
    case DType::F64: return ::torch::kDouble;
    case DType::F16: return ::torch::kHalf;
    case DType::BF16: return ::torch::kBFloat16;
    case DType::I8: return ::torch::kChar;
    case DType::U8: return ::torch::kByte;
    case DType::I32: return ::torch::kInt;
    case DType::I64: return ::torch::kLong;
  }
  throw InvalidArgument("unknown dtype in a checkpoint tensor");
}

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

}  // namespace

NamedTensor to_named(const std::string& name, const ::torch::Tensor& t) {
  auto c = t.detach().contiguous().cpu();
  NamedTensor n{name, to_dtype(c.scalar_type()), c.sizes().vec(), {}};
  const auto* p = static_cast<const uint8_t*>(c.data_ptr());
  n.bytes.assign(p, p + c.numel() * c.element_size());
  return n;
}

::torch::Tensor from_named(const NamedTensor& n) {
  auto t = ::torch::empty(n.shape, ::torch::TensorOptions().dtype(to_scalar(n.dtype)));
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
        out.push_back(to_named(pre + "step", ::torch::tensor(a->step(), ::torch::kLong)));
        out.push_back(to_named(pre + "exp_avg", a->exp_avg()));
        out.push_back(to_named(pre + "exp_avg_sq", a->exp_avg_sq()));
      } else if (auto* w = dynamic_cast<::torch::optim::AdamWParamState*>(it->second.get())) {
        out.push_back(to_named(pre + "step", ::torch::tensor(w->step(), ::torch::kLong)));
        out.push_back(to_named(pre + "exp_avg", w->exp_avg()));
        out.push_back(to_named(pre + "exp_avg_sq", w->exp_avg_sq()));
      } else {
        throw InvalidArgument("optimizer_state: only SGD, Adam and AdamW state can be saved so far");
      }
    }
  }
  return out;
}

void load_optimizer_state(::torch::optim::Optimizer& optimizer, const std::vector<NamedTensor>& tensors) {
  std::map<std::string, const NamedTensor*> by_name;
  for (const auto& t : tensors) by_name[t.name] = &t;
  auto& state = optimizer.state();
  auto& groups = optimizer.param_groups();
  bool is_sgd = dynamic_cast<::torch::optim::SGD*>(&optimizer) != nullptr;
  bool is_adamw = dynamic_cast<::torch::optim::AdamW*>(&optimizer) != nullptr;
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
        s->momentum_buffer(from_named(*it->second));
        state[state_key(params[k])] = std::move(s);
      } else {
        auto st = by_name.find(pre + "step");
        if (st == by_name.end()) continue;
        auto ea = by_name.at(pre + "exp_avg"), eas = by_name.at(pre + "exp_avg_sq");
        if (is_adamw) {
          auto s = std::make_unique<::torch::optim::AdamWParamState>();
          s->step(from_named(*st->second).item<int64_t>());
          s->exp_avg(from_named(*ea));
          s->exp_avg_sq(from_named(*eas));
          state[state_key(params[k])] = std::move(s);
        } else {
          auto s = std::make_unique<::torch::optim::AdamParamState>();
          s->step(from_named(*st->second).item<int64_t>());
          s->exp_avg(from_named(*ea));
          s->exp_avg_sq(from_named(*eas));
          state[state_key(params[k])] = std::move(s);
        }
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

}  // namespace cohort::torch
