// What a launcher fixes for a job before its first round (prepare_job: both the
// static agent, agent.cpp, and the elastic one, elastic_agent.hpp), and the
// plan of one elastic round's workers on this node.
#pragma once

#include <string>
#include <vector>

#include "launch/binding.hpp"
#include "launch/monitor.hpp"
#include "launch/options.hpp"
#include "launch/worker_env.hpp"

namespace cohort::launch {

struct JobSetup {
  std::string exe;  // resolved argv[0]
  std::vector<std::string> argv;
  std::string log_root;  // empty: no log files
  std::string host;      // this host's name
  bool set_omp = false;  // OMP_NUM_THREADS=1 for the workers
  std::string glibc_tunables;  // GLIBC_TUNABLES for the workers ("" : untouched)
  int host_cpus = 0;           // COHORT_HOST_CPUS for the workers (0: untouched; host_cpus_default)
  BindMode bind_mode = BindMode::None;
  BindPlan bind;
};

// Resolves the program, makes the log directory, plans the CPU binding. Throws
// InvalidArgument / IoError saying the fix.
JobSetup prepare_job(const LaunchOptions& opts);

// The workers of this node for one round: env from `env` (rank_base and
// world_size set), logs under attempt_<env.restart_count>.
std::vector<WorkerPlan> plan_workers(const LaunchOptions& opts, const JobSetup& job, const JobEnv& env);

std::string this_host();

}  // namespace cohort::launch
