#include "group/job_settings.hpp"

#include <algorithm>
#include <map>
#include <sstream>
#include <string_view>

#include <fmt/format.h>

#include "core/env.hpp"

namespace cohort::group {
namespace {

// The knobs that choose algorithms (collectives/tuner.cpp, native_group.cpp).
// Not here: knobs that each rank may set for itself (COHORT_SPIN_US, the
// push threshold of the allgather, whose largest value all ranks take).
constexpr std::string_view kMustAgree[] = {"COHORT_ALGO", "COHORT_HIERARCHICAL", "COHORT_PIPELINE_BYTES",
                                           "COHORT_SINGLE_COPY_BYTES", "COHORT_SINGLE_COPY_SHARED_BYTES"};

std::string normalised(const core::Knob& k) {
  switch (k.kind()) {
    case core::KnobKind::Bytes: return std::to_string(k.bytes());
    case core::KnobKind::Bool: return k.boolean() ? "1" : "0";
    case core::KnobKind::Int: return std::to_string(k.integer());
    default: return k.str();
  }
}

// name -> value, from "NAME=value" lines.
std::map<std::string, std::string> parse(const std::string& settings) {
  std::map<std::string, std::string> out;
  std::istringstream in(settings);
  for (std::string line; std::getline(in, line);) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos) out[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return out;
}

}  // namespace

std::string job_wide_settings(const std::string& transport) {
  std::string s;
  for (const core::Knob* k : core::all_knobs())
    if (std::find(std::begin(kMustAgree), std::end(kMustAgree), k->name()) != std::end(kMustAgree))
      s += fmt::format("{}={}\n", k->name(), normalised(*k));
  return s + fmt::format("transport={}\n", transport);
}

std::string settings_disagreement(const std::vector<std::string>& settings_by_rank) {
  if (settings_by_rank.empty()) return "";
  const auto first = parse(settings_by_rank[0]);
  for (size_t r = 1; r < settings_by_rank.size(); ++r) {
    if (settings_by_rank[r] == settings_by_rank[0]) continue;
    auto theirs = parse(settings_by_rank[r]);
    std::vector<std::string> names;
    for (const auto& [name, v] : first) names.push_back(name);
    for (const auto& [name, v] : theirs)
      if (!first.count(name)) names.push_back(name);
    for (const std::string& name : names) {
      auto a = first.find(name);
      auto b = theirs.find(name);
      const std::string va = a == first.end() ? "(not known to that build)" : a->second;
      const std::string vb = b == theirs.end() ? "(not known to that build)" : b->second;
      if (va == vb) continue;
      const std::string what = name == "transport" ? std::string("COHORT_TRANSPORT") : name;
      auto shown = [](const std::string& v) { return v.empty() ? std::string("unset") : v; };
      return fmt::format("{} is {} on rank {} but {} on rank 0: the settings that choose the collectives' algorithms "
                         "({}, COHORT_TRANSPORT) must be the same on every rank, or ranks run different algorithms "
                         "and wait for each other until the timeout; set them once in the launcher's environment, "
                         "which cohort run and torchrun pass to every worker",
                         what, shown(vb), r, shown(va), fmt::join(kMustAgree, ", "));
    }
  }
  return "";
}

}  // namespace cohort::group
