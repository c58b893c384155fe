#include "group/job_settings.hpp"

#include <algorithm>
#include <map>
#include <set>
#include <span>
#include <sstream>
#include <string_view>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/env.hpp"

namespace cohort::group {
namespace {

// Knobs that choose the algorithm or the wire format between any two ranks
// (collectives/tuner.cpp, native_group.cpp, transport/tcp/): every rank of the
// group must agree.
constexpr std::string_view kJobWide[] = {"COHORT_ALGO", "COHORT_HIERARCHICAL", "COHORT_NSOCKS_MIN_BYTES",
                                         "COHORT_NSOCKS_PER_PEER", "COHORT_PIPELINE_BYTES"};
// Knobs that choose between ranks of one host only (single copy, and the
// transport: peers on other hosts take tcp whatever it says; the host phases
// of the node-aware algorithms may take different forms on different hosts).
constexpr std::string_view kHostWide[] = {"COHORT_SINGLE_COPY_BYTES", "COHORT_SINGLE_COPY_SHARED_BYTES"};
// Not here: knobs each rank may set for itself (COHORT_SPIN_US; the push
// threshold of the allgather, whose largest value all ranks take).

std::string normalised(const core::Knob& k) {
  switch (k.kind()) {
    case core::KnobKind::Bytes: return std::to_string(k.bytes());
    case core::KnobKind::Bool: return k.boolean() ? "1" : "0";
    case core::KnobKind::Int: return std::to_string(k.integer());
    default: return k.str();
  }
}

bool listed(std::span<const std::string_view> list, std::string_view name) {
  return std::find(list.begin(), list.end(), name) != list.end();
}

// "scope:NAME" -> value, from "scope:NAME=value" lines.
std::map<std::string, std::string> parse(const std::string& settings) {
  std::map<std::string, std::string> out;
  std::istringstream in(settings);
  for (std::string line; std::getline(in, line);) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos) out[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return out;
}

// The first "scope:NAME" of `scope` whose values differ, with both values ("" when none differs).
struct Difference {
  std::string key, mine, theirs;
};
Difference first_difference(const std::map<std::string, std::string>& mine,
                            const std::map<std::string, std::string>& theirs, std::string_view scope) {
  std::set<std::string> keys;  // sorted, each once
  for (const auto* m : {&mine, &theirs})
    for (const auto& [k, v] : *m)
      if (k.rfind(scope, 0) == 0) keys.insert(k);
  for (const std::string& k : keys) {
    auto a = mine.find(k), b = theirs.find(k);
    const std::string va = a == mine.end() ? "(not known to that build)" : a->second;
    const std::string vb = b == theirs.end() ? "(not known to that build)" : b->second;
    if (va != vb) return {k, va, vb};
  }
  return {};
}

}  // namespace

std::string job_wide_settings(const std::string& transport) {
  std::string s;
  for (const core::Knob* k : core::all_knobs()) {
    if (listed(kJobWide, k->name())) s += fmt::format("job:{}={}\n", k->name(), normalised(*k));
    if (listed(kHostWide, k->name())) s += fmt::format("host:{}={}\n", k->name(), normalised(*k));
  }
  return s + fmt::format("host:COHORT_TRANSPORT={}\n", transport);
}

std::string settings_disagreement(const std::vector<std::string>& settings_by_rank,
                                  const std::vector<std::string>& host_by_rank) {
  std::vector<std::map<std::string, std::string>> parsed;
  for (const std::string& s : settings_by_rank) parsed.push_back(parse(s));
  auto shown = [](const std::string& v) { return v.empty() ? std::string("unset") : v; };
  std::map<std::string, size_t> first_of_host;  // host identity -> its lowest rank
  for (size_t r = 0; r < parsed.size(); ++r) {
    // Against rank 0 for the job's knobs, against the first rank of r's host for the host's.
    const size_t first_here =
        r < host_by_rank.size() ? first_of_host.try_emplace(host_by_rank[r], r).first->second : r;
    for (auto [scope, other] : {std::pair<std::string_view, size_t>{"job:", 0}, {"host:", first_here}}) {
      if (other == r) continue;
      const Difference d = first_difference(parsed[other], parsed[r], scope);
      if (d.key.empty()) continue;
      const bool job = scope == "job:";
      return fmt::format(
          "{} is {} on rank {} but {} on rank {}{}: {} must be the same on {}, or ranks run different algorithms "
          "and wait for each other until the timeout; set them once in the launcher's environment, which cohort run "
          "and torchrun pass to every worker",
          d.key.substr(scope.size()), shown(d.theirs), r, shown(d.mine), other, job ? "" : " (the same host)",
          job ? fmt::format("the settings that choose the collectives' algorithms and wire format ({})",
                            fmt::join(kJobWide, ", "))
              : fmt::format("the settings that choose between the ranks of one host ({}, COHORT_TRANSPORT)",
                            fmt::join(kHostWide, ", ")),
          job ? "every rank" : "every rank of a host");
    }
  }
  return "";
}

}  // namespace cohort::group
