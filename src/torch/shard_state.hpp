// What ZeroOptimizer and FullyShardedDataParallel share for sharded state:
// the optimizer state of one flat shard parameter (read and installed), and
// the files of a sharded checkpoint read back at another world size.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
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
    throw InvalidArgument(fmt::format("{}: \"{}\" belongs to a second param group, and a plain optimizer's state "
                                      "by position names its parameters by place in each group, not in the model; "
                                      "HINT: save it named by parameter with cohort::torch::tp::full_optimizer_state",
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

// The fields a plain optimizer's state holds per parameter (SGD, Adam, AdamW).
inline bool is_state_field(std::string_view f) {
  return f == "momentum_buffer" || f == "exp_avg" || f == "exp_avg_sq" || f == "max_exp_avg_sq" || f == "step";
}

// The names optimizer_state() gives by position, exactly: "group<g>.lr" and
// "group<g>.param<k>.<field>" (g, k decimal). A parameter's own name may
// begin with "group" too (a submodule "group_norm"): only these patterns
// are positional.
inline bool is_group_lr(const std::string& name) {
  size_t g = 0;
  int end = 0;
  return name.size() > 5 && std::isdigit(static_cast<unsigned char>(name[5])) != 0 &&
         std::sscanf(name.c_str(), "group%zu.lr%n", &g, &end) == 1 && static_cast<size_t>(end) == name.size();
}
inline bool is_positional(const std::string& name) {
  size_t g = 0, k = 0;
  int end = 0;
  return name.size() > 5 && std::isdigit(static_cast<unsigned char>(name[5])) != 0 &&
         std::sscanf(name.c_str(), "group%zu.param%zu.%n", &g, &k, &end) == 2 && end > 0;
}

// Each trainable parameter of `module` in parameters() order (each
// appearance counted: the i of "group0.param<i>"), its name there, and the
// first place of the same tensor (a tensor registered under two names, tied
// weights, has its state at its first place).
struct TrainablePlaces {
  std::vector<std::string> names;
  std::vector<size_t> first;
};
inline TrainablePlaces trainable_places(const ::torch::nn::Module& module) {
  TrainablePlaces out;
  std::map<const void*, size_t> first;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    if (!p.value().requires_grad()) continue;
    out.first.push_back(first.emplace(p.value().unsafeGetTensorImpl(), out.names.size()).first->second);
    out.names.push_back(p.key());
  }
  return out;
}

// Whether an optimizer state names its parameters by position
// ("group<g>.param<k>.<field>") rather than by name ("<name>.<field>"); the
// groups' learning rates ("group<g>.lr") go with either. A state that mixes
// the two is refused: damaged, or two states put together.
inline bool names_by_position(const std::vector<NamedTensor>& full, const char* who) {
  const bool positional = std::any_of(full.begin(), full.end(), [](const NamedTensor& t) { return is_positional(t.name); });
  const auto named = std::find_if(full.begin(), full.end(),
                                  [](const NamedTensor& t) { return !is_positional(t.name) && !is_group_lr(t.name); });
  if (positional && named != full.end())
    throw InvalidArgument(fmt::format("{}: the state names parameters both by position and by name (\"{}\"): it is "
                                      "damaged, or two states were mixed",
                                      who, named->name));
  return positional;
}

// A plain optimizer's state in the naming parse_plain_state reads, by
// position in one group over the module's trainable parameters
// ("group0.param<i>.<field>"). Two namings come in:
//   - by position (optimizer_state() of an optimizer over parameters(), as
//     DDP, one process, fsdp_optimizer_state_to_full and ZeRO save it):
//     kept. With any trace of a second param group (its learning rate too:
//     its parameters may not have stepped) the positions do not say which
//     of the model's parameters each is: refused, naming the way that works.
//   - by parameter ("<name>.<field>", tp::full_optimizer_state of an
//     optimizer with any param groups): renamed by the first place of the
//     parameter's tensor in `places`. The groups' learning rates are the
//     saving optimizer's: dropped (ZeRO and FSDP keep their own). A state of
//     learning rates only (saved before any step) is read this way: empty.
inline std::vector<NamedTensor> plain_state_by_position(const std::vector<NamedTensor>& full,
                                                        const TrainablePlaces& places, const char* who) {
  if (names_by_position(full, who)) {
    for (const NamedTensor& t : full)
      if (t.name.rfind("group0.", 0) != 0) (void)param_field(t.name, who);  // throws, naming the way out
    return full;
  }
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < places.names.size(); ++i) index.emplace(places.names[i], places.first[i]);
  std::vector<NamedTensor> out;
  for (const NamedTensor& t : full) {
    if (is_group_lr(t.name)) continue;
    const size_t dot = t.name.rfind('.');
    const std::string field = dot == std::string::npos ? std::string() : t.name.substr(dot + 1);
    if (!is_state_field(field))
      throw InvalidArgument(fmt::format("{}: \"{}\" is not a parameter's optimizer state (<parameter>.exp_avg, "
                                        ".exp_avg_sq, .max_exp_avg_sq, .step or .momentum_buffer)",
                                        who, t.name));
    const auto it = index.find(t.name.substr(0, dot));
    if (it == index.end())
      throw InvalidArgument(fmt::format("{}: the state has \"{}\", but the module has no trainable parameter \"{}\": "
                                        "another model",
                                        who, t.name, t.name.substr(0, dot)));
    NamedTensor renamed = t;
    renamed.name = fmt::format("group0.param{}.{}", it->second, field);
    out.push_back(std::move(renamed));
  }
  return out;
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

// ---- Param groups: a chunk cut into runs of one group each ----

// Elements [start, start + len) of a rank's chunk that belong to parameters
// of param group `group` (gaps and padding go with the parameter before).
struct RunSpan {
  size_t start = 0, len = 0, group = 0;
};

// The runs of rank `rank`'s chunk [rank * chunk, (rank + 1) * chunk) of a
// flat buffer of `count` elements that holds parameters `params` (indices)
// at `offsets` (ascending); `sizes` and `groups` give each parameter's
// elements and param group by index. Consecutive elements of one group are
// merged; zero-size parameters take no run.
inline std::vector<RunSpan> runs_of(const std::vector<size_t>& params, const std::vector<size_t>& offsets,
                                    const std::vector<size_t>& sizes, const std::vector<size_t>& groups, size_t count,
                                    size_t chunk, int rank) {
  std::vector<std::pair<size_t, size_t>> starts;  // (offset, group)
  for (size_t j = 0; j < params.size(); ++j)
    if (sizes.at(params[j]) > 0) starts.emplace_back(offsets[j], groups.at(params[j]));
  const size_t lo = static_cast<size_t>(rank) * chunk, hi = lo + chunk;
  std::vector<RunSpan> out;
  for (size_t j = 0; j < starts.size(); ++j) {
    const size_t from = std::max(j == 0 ? size_t{0} : starts[j].first, lo);
    const size_t to = std::min(j + 1 < starts.size() ? starts[j + 1].first : count, hi);
    if (from >= to) continue;
    if (!out.empty() && out.back().group == starts[j].second)
      out.back().len += to - from;
    else
      out.push_back({from - lo, to - from, starts[j].second});
  }
  return out;
}

// Each parameter's param group by index (0: no group names it; g:
// `groups[g - 1]` does). `index_by_name` maps every name of a trainable
// parameter to its index; `listed` are the names quoted when one is
// unknown. InvalidArgument for an empty group, an unknown name or a name in
// two groups, each starting "<prefix><label> <g>".
inline std::vector<size_t> assign_groups(const std::map<std::string, size_t>& index_by_name,
                                         const std::vector<std::string>& listed, size_t count,
                                         const std::vector<std::vector<std::string>>& groups, const std::string& prefix,
                                         const char* label) {
  std::vector<size_t> out(count, 0);
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string which = fmt::format("{}{} {}", prefix, label, g + 1);
    if (groups[g].empty()) throw InvalidArgument(fmt::format("{} names no parameter", which));
    for (const std::string& name : groups[g]) {
      const auto at = index_by_name.find(name);
      if (at == index_by_name.end()) {
        std::string some;
        for (size_t i = 0; i < std::min<size_t>(listed.size(), 6); ++i) some += (i ? ", " : "") + listed[i];
        throw InvalidArgument(fmt::format("{} names '{}', which is not a trainable parameter of the model (its "
                                          "trainable parameters: {}{})",
                                          which, name, some, listed.size() > 6 ? ", ..." : ""));
      }
      size_t& mine = out.at(at->second);
      if (mine != 0)
        throw InvalidArgument(fmt::format("{} names '{}', which {} {} names already: a parameter steps in one group",
                                          which, name, label, mine));
      mine = g + 1;
    }
  }
  return out;
}

// The state fields every rank saves for every chunk, decided from the
// groups' options alone, so that all ranks' files name the same tensors (a
// rank whose chunk holds only a group without momentum still writes zeros
// for it): nothing before the first step.
inline std::vector<std::string> saved_fields(::torch::optim::Optimizer& o, bool has_state) {
  if (!has_state) return {};
  const Kind kind = kind_of(o);
  bool extra = false;  // SGD: some group has momentum; Adam(W): some group has amsgrad
  for (auto& g : o.param_groups()) {
    if (kind == kSgd) extra |= static_cast<::torch::optim::SGDOptions&>(g.options()).momentum() != 0;
    if (kind == kAdam) extra |= static_cast<::torch::optim::AdamOptions&>(g.options()).amsgrad();
    if (kind == kAdamW) extra |= static_cast<::torch::optim::AdamWOptions&>(g.options()).amsgrad();
  }
  if (kind == kSgd) return extra ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{};
  std::vector<std::string> out{"exp_avg", "exp_avg_sq"};
  if (extra) out.emplace_back("max_exp_avg_sq");
  return out;
}

// A chunk's state from its runs' (`runs`: each run's shard parameter and
// length, in chunk order): each of `fields`, the runs' tensors concatenated;
// a run without it (a group that keeps none, e.g. SGD without momentum)
// contributes zeros of `type` on `device` (the state's).
inline ShardState chunk_state(::torch::optim::Optimizer& optimizer,
                              const std::vector<std::pair<::torch::Tensor, size_t>>& runs,
                              const std::vector<std::string>& fields, ::torch::ScalarType type,
                              const ::torch::Device& device = ::torch::kCPU) {
  std::vector<ShardState> parts;
  ShardState out;
  for (const auto& [param, len] : runs) {
    parts.push_back(state_of(optimizer, param));
    out.step = std::max(out.step, parts.back().step);
  }
  for (const std::string& field : fields) {
    std::vector<::torch::Tensor> pieces;
    for (size_t i = 0; i < runs.size(); ++i) {
      const auto& f = parts[i].fields;
      const auto it = std::find_if(f.begin(), f.end(), [&](const auto& x) { return x.first == field; });
      pieces.push_back(it != f.end() ? it->second
                                     : ::torch::zeros({static_cast<int64_t>(runs[i].second)},
                                                      ::torch::TensorOptions().dtype(type).device(device)));
    }
    out.fields.emplace_back(field, pieces.size() == 1 ? pieces.front() : ::torch::cat(pieces));
  }
  return out;
}

// The other way: a chunk's state cut at its runs (each its own tensors;
// one run keeps the chunk's).
inline std::vector<ShardState> split_state(const ShardState& s, const std::vector<std::pair<::torch::Tensor, size_t>>& runs) {
  std::vector<ShardState> out;
  int64_t at = 0;
  for (const auto& [param, len] : runs) {
    ShardState part{.fields = {}, .step = s.step};
    for (const auto& [field, t] : s.fields)
      part.fields.emplace_back(field, runs.size() == 1 ? t : t.narrow(0, at, static_cast<int64_t>(len)).clone());
    at += static_cast<int64_t>(len);
    out.push_back(std::move(part));
  }
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
