#include "launch/binding.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "cohort/error.hpp"

namespace cohort::launch {
namespace {

core::CpuList intersect(const core::CpuList& a, const core::CpuList& b) {
  core::CpuList out;
  std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
  return out;
}

core::CpuList join(const std::vector<core::CpuList>& lists) {
  core::CpuList out;
  for (const auto& l : lists) out.insert(out.end(), l.begin(), l.end());
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace

BindMode parse_bind(const std::string& text) {
  if (text == "auto") return BindMode::Auto;
  if (text == "none") return BindMode::None;
  if (text == "numa") return BindMode::Numa;
  if (text == "core") return BindMode::Core;
  throw InvalidArgument(fmt::format("--bind {}: expected auto (the default: core when 2 <= local ranks <= cores, "
                                    "else none), none (no pinning), numa (each local rank on the CPUs of one NUMA "
                                    "node) or core (each local rank on its own cores)",
                                    text));
}

const char* bind_name(BindMode mode) {
  switch (mode) {
    case BindMode::Auto: return "auto";
    case BindMode::None: return "none";
    case BindMode::Numa: return "numa";
    case BindMode::Core: return "core";
  }
  return "?";
}

BindPlan plan_binding(BindMode mode, int nproc, const topo::CpuLayout& layout, const core::CpuList& allowed_in) {
  BindPlan plan;
  plan.mode = mode;
  if (mode == BindMode::None || nproc < 1) {
    plan.mode = BindMode::None;
    return plan;
  }
  core::CpuList allowed = allowed_in;
  std::sort(allowed.begin(), allowed.end());

  // NUMA nodes and cores restricted to the CPUs the launcher may use.
  std::vector<core::CpuList> nodes;
  for (const auto& n : layout.numa)
    if (auto c = intersect(n, allowed); !c.empty()) nodes.push_back(std::move(c));
  if (nodes.empty() && mode == BindMode::Auto) {  // a strange sysfs: auto never stops a job from starting
    plan.mode = BindMode::None;
    return plan;
  }
  if (nodes.empty())
    throw InvalidArgument(fmt::format("--bind {}: none of this host's CPUs ({}) is in the launcher's affinity ({}); "
                                      "run `cohort run` without --bind, or with a wider taskset / cpuset",
                                      bind_name(mode), core::cpu_list_text(layout.online),
                                      core::cpu_list_text(allowed)));
  auto node_of = [&](int cpu) {
    for (size_t i = 0; i < nodes.size(); ++i)
      if (std::binary_search(nodes[i].begin(), nodes[i].end(), cpu)) return i;
    return nodes.size();
  };

  if (mode == BindMode::Numa) {
    for (int i = 0; i < nproc; ++i)
      plan.cpus.push_back(nodes[static_cast<size_t>(i) * nodes.size() / static_cast<size_t>(nproc)]);
    return plan;
  }

  std::vector<core::CpuList> cores;
  for (const auto& c : layout.cores)
    if (auto u = intersect(c, allowed); !u.empty()) cores.push_back(std::move(u));
  if (cores.empty())  // a layout without core information: every allowed CPU is a core
    for (int cpu : join(nodes)) cores.push_back({cpu});
  std::stable_sort(cores.begin(), cores.end(), [&](const core::CpuList& a, const core::CpuList& b) {
    return std::make_pair(node_of(a.front()), a.front()) < std::make_pair(node_of(b.front()), b.front());
  });
  const size_t C = cores.size(), n = static_cast<size_t>(nproc);
  plan.usable_cores = C;
  if (mode == BindMode::Auto) {
    if (n < 2 || n > C) {
      plan.mode = BindMode::None;
      return plan;
    }
    plan.mode = BindMode::Core;
  }
  if (n > C) {
    plan.oversubscribed = true;
    for (size_t i = 0; i < n; ++i) plan.cpus.push_back(cores[i % C]);
    return plan;
  }
  for (size_t i = 0; i < n; ++i) {
    std::vector<core::CpuList> mine(cores.begin() + static_cast<long>(i * C / n),
                                    cores.begin() + static_cast<long>((i + 1) * C / n));
    plan.cpus.push_back(join(mine));
  }
  return plan;
}

BindPlan plan_binding_here(BindMode mode, int nproc, topo::CpuLayout (*load)()) {
  if (mode == BindMode::None) return plan_binding(mode, nproc, {}, {});
  topo::CpuLayout layout;
  try {
    layout = load();
  } catch (const IoError& e) {
    if (mode != BindMode::Auto)
      throw IoError(fmt::format("--bind {} needs this host's CPU layout, which hwloc could not read: {}; or run with "
                                "--bind none",
                                bind_name(mode), e.what()));
    BindPlan plan;
    plan.note = fmt::format("workers are not pinned: hwloc could not read the CPU layout ({})", e.what());
    return plan;
  }
  return plan_binding(mode, nproc, layout, core::current_affinity());
}

std::string describe_binding(BindMode asked, const BindPlan& plan) {
  const std::string flag = asked == BindMode::Auto ? fmt::format("--bind auto ({})", bind_name(plan.mode))
                                                   : fmt::format("--bind {}", bind_name(asked));
  if (!plan.note.empty()) return flag + ": " + plan.note;
  if (plan.mode == BindMode::None)
    return flag + ": workers are not pinned (they inherit the launcher's CPU affinity)";
  std::string s = flag + ":";
  for (size_t i = 0; i < plan.cpus.size(); ++i)
    s += fmt::format("{} local rank {} -> CPUs {}", i ? "," : "", i, core::cpu_list_text(plan.cpus[i]));
  if (plan.oversubscribed) s += " (more local ranks than cores: some share a core)";
  return s;
}

}  // namespace cohort::launch
