// The host's CPUs as the kernel shows them in sysfs, without hwloc (libcohort
// stays free of it; `cohort topo` has the full hwloc view): online CPUs, NUMA
// nodes with their CPUs, physical cores with their hardware threads, and this
// process's affinity. Used by the INFO log at init ("topology seen") and by
// `cohort run --bind` (which cores each local rank gets).
//
// Every reader falls back to something sane when sysfs is missing (a container
// without /sys/devices/system/node: one NUMA node holding every online CPU).
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

struct CpuLayout {
  CpuList online;                 // /sys/devices/system/cpu/online
  std::vector<CpuList> numa;      // CPUs of each NUMA node that has any, by node number
  std::vector<int> numa_ids;      // the node numbers, parallel to `numa`
  std::vector<CpuList> cores;     // hardware threads of each physical core, by lowest CPU
};

// Reads sysfs under `root` (tests pass a fake tree; default the real one).
CpuLayout read_cpu_layout(const std::string& root = "/sys/devices/system");

// This process's CPU affinity (sched_getaffinity); empty when the call fails.
CpuList current_affinity();

// One line for the INFO log: "2 CPUs online (0-1), 2 cores, 1 NUMA node (node0: 0-1); affinity 0-1".
std::string describe_host_cpus(const CpuLayout& layout, const CpuList& affinity);

}  // namespace cohort::core
