// `cohort run --bind auto|none|numa|core`: which CPUs each local rank may run on.
//
//   auto  (default) core when there are at least 2 local ranks and no more
//         than the usable cores; none otherwise (1 rank: nothing to keep apart;
//         more ranks than cores: they must share, let the scheduler balance).
//         Measured on the 2-core VM (docs/launcher.md): pinned, 2 ranks ran
//         small allreduces ~100x faster (no 30 us spin on a shared core);
//         16 MiB ones were ~1.5x slower while other builds loaded the cores.
//   none  no pinning: workers inherit the launcher's affinity and the kernel's
//         scheduler places them. Use it when several launchers share a host
//         (each would hand out the same cores) or other jobs are pinned there.
//   numa  local rank i gets every CPU of one NUMA node: node floor(i * N / n)
//         for n local ranks on N nodes (neighbouring ranks, which talk most in
//         a ring, share a node; with fewer ranks than nodes they spread out).
//         Memory a worker allocates then stays local to the CPUs it runs on.
//   core  local rank i gets its own whole cores (all their hardware threads):
//         the cores, ordered by NUMA node then CPU number, are cut into n
//         contiguous blocks of floor/ceil(C / n) cores. With more ranks than
//         cores (oversubscribed), rank i gets core i mod C and ranks share.
//
// Only CPUs the launcher itself may use (its sched_getaffinity, e.g. a Slurm
// or container cpuset) are handed out. The plan is a pure function of the
// layout (topo::CpuLayout, which hwloc reads: the same lists `cohort topo`
// prints), so tests call it with made-up machines; the worker applies it with
// sched_setaffinity between fork and exec.
#pragma once

#include <string>
#include <vector>

#include "core/cpu_list.hpp"
#include "topo/topology.hpp"

namespace cohort::launch {

enum class BindMode { Auto, None, Numa, Core };

// "auto" | "none" | "numa" | "core"; throws InvalidArgument naming --bind otherwise.
BindMode parse_bind(const std::string& text);
const char* bind_name(BindMode mode);

struct BindPlan {
  BindMode mode = BindMode::None;   // what auto resolved to (never Auto)
  std::vector<core::CpuList> cpus;  // per local rank; empty when mode is None
  bool oversubscribed = false;      // core: more ranks than cores, some share
  size_t usable_cores = 0;          // core: the cores it handed out from
  std::string note;                 // why auto chose none when the layout could not be read, else ""
};

// Throws InvalidArgument when `allowed` leaves no CPU of the layout to bind to.
BindPlan plan_binding(BindMode mode, int nproc, const topo::CpuLayout& layout, const core::CpuList& allowed);

// The plan for this host: reads the layout with hwloc (topo::load_cpu_layout)
// unless mode is None. When hwloc cannot read it, auto falls back to none
// (BindPlan::note says why) and numa / core throw IoError naming hwloc's
// reason and --bind none. `load` is the reader (tests pass one that fails).
BindPlan plan_binding_here(BindMode mode, int nproc, topo::CpuLayout (*load)() = &topo::load_cpu_layout);

// The launcher's INFO line: "--bind auto (core): local rank 0 -> CPUs 0, local rank 1 -> CPUs 1".
std::string describe_binding(BindMode asked, const BindPlan& plan);

}  // namespace cohort::launch
