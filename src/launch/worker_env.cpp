#include "launch/worker_env.hpp"

#include <algorithm>
#include <cstring>
#include <map>

#include <fmt/format.h>

namespace cohort::launch {

EnvVars worker_env_vars(const JobEnv& job, int local_rank) {
  const int world_size = job.world_size >= 0 ? job.world_size : job.nnodes * job.nproc_per_node;
  const int rank = (job.rank_base >= 0 ? job.rank_base : job.node_rank * job.nproc_per_node) + local_rank;
  EnvVars v = {
      {"RANK", std::to_string(rank)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"WORLD_SIZE", std::to_string(world_size)},
      {"LOCAL_WORLD_SIZE", std::to_string(job.nproc_per_node)},
      {"GROUP_RANK", std::to_string(job.node_rank)},
      {"GROUP_WORLD_SIZE", std::to_string(job.nnodes)},
      // One role per job (torchrun's default): role ranks are the global ranks.
      {"ROLE_RANK", std::to_string(rank)},
      {"ROLE_WORLD_SIZE", std::to_string(world_size)},
      {"ROLE_NAME", job.role},
      {"MASTER_ADDR", job.master_addr},
      {"MASTER_PORT", std::to_string(job.master_port)},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(job.restart_count)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(job.max_restarts)},
      {"TORCHELASTIC_RUN_ID", job.run_id},
      // The launcher's store is not c10d's agent store: programs must open their own.
      {"TORCHELASTIC_USE_AGENT_STORE", "False"},
      {"COHORT_STORE_ADDR", job.store_addr},
      {"COHORT_STORE_PORT", std::to_string(job.store_port)},
      {"COHORT_RUN_ID", job.cohort_run_id},
  };
  if (job.set_omp_threads) v.emplace_back("OMP_NUM_THREADS", "1");
  if (!job.glibc_tunables.empty()) v.emplace_back("GLIBC_TUNABLES", job.glibc_tunables);
  if (job.host_cpus > 0) v.emplace_back("COHORT_HOST_CPUS", std::to_string(job.host_cpus));
  return v;
}

int host_cpus_default(const char* user, int launcher_cpus) {
  if (user != nullptr && *user != '\0') return 0;
  return std::max(0, launcher_cpus);
}

std::vector<std::string> merge_environment(char** base, const EnvVars& vars) {
  std::map<std::string, size_t> index;  // name -> position in out
  std::vector<std::string> out;
  for (char** e = base; e != nullptr && *e != nullptr; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (eq == nullptr) continue;
    std::string name(*e, static_cast<size_t>(eq - *e));
    if (index.count(name)) continue;  // first definition wins, as getenv does
    index[name] = out.size();
    out.emplace_back(*e);
  }
  for (const auto& [name, value] : vars) {
    auto it = index.find(name);
    if (it != index.end()) {
      out[it->second] = name + "=" + value;
    } else {
      index[name] = out.size();
      out.push_back(name + "=" + value);
    }
  }
  return out;
}

bool omp_threads_default_needed(const char* current_value, int nproc_per_node) {
  return (current_value == nullptr || *current_value == '\0') && nproc_per_node > 1;
}

std::string omp_threads_notice(int nproc_per_node) {
  return fmt::format("cohort run: setting OMP_NUM_THREADS=1 for each of the {} workers per node (it was unset) so they "
                     "do not overload the CPUs; set it yourself to tune performance", nproc_per_node);
}

std::string malloc_tunables_default(const char* glibc_tunables, const char* malloc_trim, const char* malloc_mmap,
                                    bool enabled) {
  auto set = [](const char* v) { return v != nullptr && *v != '\0'; };
  if (!enabled || set(glibc_tunables) || set(malloc_trim) || set(malloc_mmap)) return "";
  return "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=268435456";
}

}  // namespace cohort::launch
