// What ZeroOptimizer and FullyShardedDataParallel share for sharded state:
// the optimizer state of one flat shard parameter (read and installed), and
// the files of a sharded checkpoint read back at another world size.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "cohort/error.hpp"
#include "cohort/torch_train.hpp"
#include "state_key.hpp"

namespace cohort::torch::shard {

enum Kind : int64_t { kSgd = 0, kAdam = 1, kAdamW = 2 };
inline constexpr const char* kKindNames[] = {"SGD", "Adam", "AdamW"};

inline Kind kind_of(::torch::optim::Optimizer& o) {
  if (dynamic_cast<::torch::optim::AdamW*>(&o)) return kAdamW;
  if (dynamic_cast<::torch::optim::Adam*>(&o)) return kAdam;
  return kSgd;
}

// A shard parameter's state tensors by field, and its step (Adam's).
struct ShardState {
  std::vector<std::pair<std::string, ::torch::Tensor>> fields;
  int64_t step = 0;
};

inline ShardState state_of(::torch::optim::Optimizer& o, const ::torch::Tensor& p) {
  ShardState out;
  auto it = o.state().find(state_key(p));
  if (it == o.state().end()) return out;
  const auto add = [&](const char* name, const ::torch::Tensor& t) {
    if (t.defined()) out.fields.emplace_back(name, t);
  };
  if (auto* a = dynamic_cast<::torch::optim::AdamParamState*>(it->second.get())) {
    out.step = a->step();
    add("exp_avg", a->exp_avg());
    add("exp_avg_sq", a->exp_avg_sq());
    add("max_exp_avg_sq", a->max_exp_avg_sq());
  } else if (auto* w = dynamic_cast<::torch::optim::AdamWParamState*>(it->second.get())) {
    out.step = w->step();
    add("exp_avg", w->exp_avg());
    add("exp_avg_sq", w->exp_avg_sq());
    add("max_exp_avg_sq", w->max_exp_avg_sq());
  } else if (auto* g = dynamic_cast<::torch::optim::SGDParamState*>(it->second.get())) {
    add("momentum_buffer", g->momentum_buffer());
  }
  return out;
}

template <class S>
std::unique_ptr<::torch::optim::OptimizerParamState> adam_like(const ShardState& s) {
  auto out = std::make_unique<S>();
  out->step(s.step);
  for (const auto& [name, t] : s.fields) {
    if (name == "exp_avg") out->exp_avg(t);
    if (name == "exp_avg_sq") out->exp_avg_sq(t);
    if (name == "max_exp_avg_sq") out->max_exp_avg_sq(t);
  }
  return out;
}

// The saving run's files by rank, read once each, by tensor name.
class ShardFiles {
 public:
  explicit ShardFiles(const std::function<std::vector<NamedTensor>(int rank)>& read) : read_(read) {}
  const std::map<std::string, const NamedTensor*>& get(int rank) {
    if (!by_name_.contains(rank)) {
      files_[rank] = read_(rank);
      for (const auto& t : files_[rank]) by_name_[rank][t.name] = &t;
    }
    return by_name_[rank];
  }
  // Rank `rank`'s tensor `name` as a 1-D tensor of `count` elements of `type`; InvalidArgument otherwise.
  ::torch::Tensor chunk(int rank, const std::string& name, int64_t count, ::torch::ScalarType type, const char* who) {
    const auto& theirs = get(rank);
    const auto found = theirs.find(name);
    if (found == theirs.end())
      throw InvalidArgument(fmt::format("{}: rank {}'s shard lacks \"{}\"{}: the checkpoint is incomplete, mixed "
                                        "from two runs, or holds other state than this call loads",
                                        who, rank, name, rank == 0 ? "" : ", which rank 0's has"));
    ::torch::Tensor t = from_named(*found->second);
    if (t.numel() != count || t.scalar_type() != type)
      throw InvalidArgument(fmt::format("{}: \"{}\" of rank {} has {} elements of {}; the layout says {} of {}", who,
                                        name, rank, t.numel(), c10::toString(t.scalar_type()), count,
                                        c10::toString(type)));
    return t.reshape({count});
  }

  // The whole tensor `name` (world x chunk elements, padding included) joined from every saving rank's chunk.
  ::torch::Tensor whole(const std::string& name, int world, int64_t chunk, ::torch::ScalarType type, const char* who) {
    std::vector<::torch::Tensor> parts;
    for (int q = 0; q < world; ++q) parts.push_back(this->chunk(q, name, chunk, type, who));
    return ::torch::cat(parts);
  }

  // This rank's `chunk` elements of a tensor split into chunks of `old_chunk`
  // by the saving run (its first `used` elements are data; the rest, the
  // padding, stays zero), read from the old chunks that overlap them.
  ::torch::Tensor rechunk(const std::string& name, ::torch::ScalarType type, int rank, size_t chunk, size_t used,
                          int64_t old_chunk, const char* who) {
    auto fresh = ::torch::zeros({static_cast<int64_t>(chunk)}, ::torch::TensorOptions().dtype(type));
    const int64_t lo = static_cast<int64_t>(rank) * static_cast<int64_t>(chunk);
    const int64_t hi = std::min<int64_t>(lo + static_cast<int64_t>(chunk), static_cast<int64_t>(used));
    for (int64_t at = lo; at < hi;) {
      const int q = static_cast<int>(at / old_chunk);
      const int64_t end = std::min<int64_t>(hi, (q + 1) * old_chunk);
      const ::torch::Tensor old = this->chunk(q, name, old_chunk, type, who);
      fresh.narrow(0, at - lo, end - at).copy_(old.narrow(0, at - q * old_chunk, end - at));
      at = end;
    }
    return fresh;
  }

 private:
  const std::function<std::vector<NamedTensor>(int rank)>& read_;
  std::map<int, std::vector<NamedTensor>> files_;
  std::map<int, std::map<std::string, const NamedTensor*>> by_name_;
};

// "group0.param<k>.<field>" -> (k, field); nullopt for other names ("group0.lr").
inline std::optional<std::pair<size_t, std::string>> param_field(const std::string& name, const char* who) {
  if (name.rfind("group", 0) != 0) return std::nullopt;
  if (name.rfind("group0.", 0) != 0)
    throw InvalidArgument(fmt::format("{}: \"{}\" belongs to a second param group; sharded optimizer state has one",
                                      who, name));
  constexpr std::string_view kParam = "group0.param";
  if (name.rfind(kParam, 0) != 0) return std::nullopt;
  const size_t dot = name.find('.', kParam.size());
  if (dot == std::string::npos) return std::nullopt;
  const std::string index = name.substr(kParam.size(), dot - kParam.size());
  if (index.empty() || index.find_first_not_of("0123456789") != std::string::npos || index.size() > 9)
    throw InvalidArgument(fmt::format("{}: \"{}\" is not \"group0.param<index>.<field>\": the state is damaged or "
                                      "not an optimizer's",
                                      who, name));
  return std::pair{static_cast<size_t>(std::stoul(index)), name.substr(dot + 1)};
}

// A plain optimizer's state as optimizer_state() saves it (one param group,
// over `params` trainable parameters): its tensors by parameter index and
// field, and the step. Throws InvalidArgument for a parameter index past
// `params` or the state of another kind of optimizer than `kind`.
struct PlainState {
  std::map<size_t, std::map<std::string, const NamedTensor*>> by_param;
  int64_t steps = 0;
};
inline PlainState parse_plain_state(const std::vector<NamedTensor>& full, size_t params, Kind kind, const char* who) {
  PlainState out;
  bool sgd_state = false, adam_state = false;
  for (const auto& t : full) {
    const auto pf = param_field(t.name, who);
    if (!pf) continue;
    if (pf->first >= params)
      throw InvalidArgument(fmt::format("{}: \"{}\" is for parameter {}, but the module has {} trainable ones: "
                                        "another model",
                                        who, t.name, pf->first, params));
    if (pf->second == "step") {
      const ::torch::Tensor step = from_named(t);
      if (step.numel() != 1)
        throw InvalidArgument(fmt::format("{}: \"{}\" holds {} values; a step is one number", who, t.name, step.numel()));
      out.steps = std::max(out.steps, step.to(::torch::kLong).item<int64_t>());
      continue;
    }
    sgd_state |= pf->second == "momentum_buffer";
    adam_state |= pf->second == "exp_avg";
    out.by_param[pf->first][pf->second] = &t;
  }
  if ((kind == kSgd && adam_state) || (kind != kSgd && sgd_state))
    throw InvalidArgument(fmt::format("{}: the state is {}'s, this optimizer is {}; HINT: resume with the optimizer it "
                                      "was written with",
                                      who, sgd_state ? "SGD" : "Adam/AdamW", kKindNames[kind]));
  return out;
}

// Installs `s` as the state of shard parameter `p` (none: forgets it, as
// before the first step).
inline void install_state(::torch::optim::Optimizer& o, const ::torch::Tensor& p, Kind kind, const ShardState& s) {
  if (s.fields.empty()) {
    o.state().erase(state_key(p));
    return;
  }
  auto& slot = o.state()[state_key(p)];
  if (kind == kSgd) {
    auto g = std::make_unique<::torch::optim::SGDParamState>();
    g->momentum_buffer(s.fields.front().second);
    slot = std::move(g);
  } else if (kind == kAdam) {
    slot = adam_like<::torch::optim::AdamParamState>(s);
  } else {
    slot = adam_like<::torch::optim::AdamWParamState>(s);
  }
}

}  // namespace cohort::torch::shard
