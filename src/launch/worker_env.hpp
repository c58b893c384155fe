// The environment contract between the launcher and each worker: torchrun's
// variable names, so that programs written for torchrun run unchanged, plus
// cohort's own COHORT_STORE_ADDR / COHORT_STORE_PORT / COHORT_RUN_ID.
// Pure functions; the agent calls them once per worker per attempt.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace cohort::launch {

// What every worker of one node and one attempt shares.
struct JobEnv {
  int nproc_per_node = 1;   // LOCAL_WORLD_SIZE (the same on every node for now)
  int nnodes = 1;           // GROUP_WORLD_SIZE
  int node_rank = 0;        // GROUP_RANK
  std::string role = "default";
  std::string master_addr;
  int master_port = 0;
  std::string store_addr;   // COHORT_STORE_ADDR: the launcher-hosted store
  int store_port = 0;
  int restart_count = 0;    // TORCHELASTIC_RESTART_COUNT
  int max_restarts = 0;
  std::string run_id;       // TORCHELASTIC_RUN_ID (the user's --rdzv-id)
  std::string cohort_run_id;  // COHORT_RUN_ID: unique per job, names /dev/shm/cohort-<id>-*
  bool set_omp_threads = false;  // OMP_NUM_THREADS=1 (see omp_threads_default_needed)
  std::string glibc_tunables;    // GLIBC_TUNABLES for the workers; empty: untouched (see malloc_tunables_default)
  // COHORT_HOST_CPUS: the CPUs the workers share (the launcher's affinity);
  // 0: not set, as when the user set COHORT_HOST_CPUS (see host_cpus_default).
  int host_cpus = 0;
  // Elastic rendezvous: nodes may run different numbers of workers, so the
  // global rank of local rank 0 and the world size come from the round.
  // -1: node_rank * nproc_per_node and nnodes * nproc_per_node.
  int rank_base = -1;
  int world_size = -1;
};

using EnvVars = std::vector<std::pair<std::string, std::string>>;

// The variables worker `local_rank` gets, in a fixed order. Global RANK is
// node_rank * nproc_per_node + local_rank (rank_base + local_rank when set).
EnvVars worker_env_vars(const JobEnv& job, int local_rank);

// COHORT_HOST_CPUS for the workers: 0 (leave it) when the user set it
// (`user`, from the launcher's environment), else the number of CPUs the
// launcher may run on, which its unpinned workers inherit.
int host_cpus_default(const char* user, int launcher_cpus);

// `base` (a NULL-terminated environ) with `vars` set over it, as "K=V" strings.
std::vector<std::string> merge_environment(char** base, const EnvVars& vars);

// torchrun sets OMP_NUM_THREADS=1 for every worker when it is unset and there is
// more than one worker per node, so N workers do not each start one thread per CPU.
bool omp_threads_default_needed(const char* current_value, int nproc_per_node);
// The one-line notice printed when it does so.
std::string omp_threads_notice(int nproc_per_node);

// glibc's malloc settings for the workers (GLIBC_TUNABLES), or "" to leave
// the environment alone. By default glibc returns freed memory at the top of
// the heap to the kernel once more than a trim threshold is free, and serves
// big blocks with mmap; both thresholds start at 128 KiB and only grow when
// the program happens to free a big mmapped block. A training step allocates
// and frees the same activations every step, so with small thresholds every
// step gives megabytes back and faults them in again (a plain LibTorch CNN
// loop: ~3,000 page faults per step and 20-26% of its time, docs/performance-history.md).
// Fixed thresholds (mmap 32 MiB, glibc's largest; trim 256 MiB) keep that
// memory in the process. Left alone when the user set GLIBC_TUNABLES or one of
// glibc's MALLOC_*_ variables, or turned it off (COHORT_MALLOC_TUNING=0).
std::string malloc_tunables_default(const char* glibc_tunables, const char* malloc_trim, const char* malloc_mmap,
                                    bool enabled);

}  // namespace cohort::launch
