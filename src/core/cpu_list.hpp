// CPU lists: the kernel's "0-3,8" text, and this process's affinity.
//
// The host's layout (cores, NUMA nodes) is read in one place only, through
// hwloc (topo/topology.hpp, load_cpu_layout): `cohort topo` shows it and
// `cohort run --bind` plans with it, so the two cannot disagree.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace cohort::core {

using CpuList = std::vector<int>;  // sorted, unique OS CPU numbers

// "0-3,8,10-11" (the kernel's cpulist format) -> {0,1,2,3,8,10,11}; nullopt on
// malformed text. "" -> {}.
std::optional<CpuList> parse_cpu_list(const std::string& text);
// The inverse, with ranges folded: {0,1,2,5} -> "0-2,5"; {} -> "none".
std::string cpu_list_text(const CpuList& cpus);

// This process's CPU affinity (sched_getaffinity); empty when the call fails.
CpuList current_affinity();

// One line for the INFO log at init: "2 CPU(s) online; this process may run on CPUs 0 (...)".
std::string describe_affinity(const CpuList& affinity);

}  // namespace cohort::core
