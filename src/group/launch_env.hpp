// Where this process sits in the job, read from whichever launcher started it.
//
// init_process_group needs a rank, a world size and the address of the store
// (served by rank 0, or by `cohort run`'s agent). torchrun and `cohort run` say
// so in RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; mpirun, srun and
// MPICH's mpiexec each use their own variables. read_launch_env looks for them
// in this order, and the first launcher whose variables are present decides:
//
//   1. torchrun / cohort run   RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
//                              (+ COHORT_STORE_ADDR/PORT under `cohort run`)
//   2. Open MPI                OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}
//   3. PMI (MPICH, Intel MPI)  PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS
//   4. Slurm (srun)            SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
//                              SLURM_TASKS_PER_NODE + SLURM_NODEID, or SLURM_NTASKS_PER_NODE
//   5. PMIx alone              PMIX_RANK, size from PMI_SIZE
//
// MPI launchers come before Slurm because mpirun / mpiexec run inside Slurm
// jobs, where the batch step's SLURM_PROCID (0 in every process) is still set
// and wrong. Slurm comes before bare PMIx because `srun --mpi=pmix` sets both,
// and Slurm's variables are the complete set.
//
// The store's address: MASTER_ADDR when set; else 127.0.0.1 when every rank is
// on this host (local size == world size: needs no name resolution); else the
// first host of the Slurm node list (srun places task 0 on the step's first
// node under its default block and cyclic distributions); else InvalidArgument.
// The port: MASTER_PORT, else 29500 (torchrun's default; two jobs sharing a
// node with the default port collide: give each its own MASTER_PORT).
//
// Pure functions: tests pass maps; init_process_group passes process_env().
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace cohort::group {

using EnvMap = std::map<std::string, std::string>;

inline constexpr int kDefaultMasterPort = 29500;

struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  std::optional<int> local_rank;        // unknown when the launcher did not say
  std::optional<int> local_world_size;  // ranks on this host, when known
  std::string master_addr;              // the store's host
  int master_port = kDefaultMasterPort; // the store's port
  // true under `cohort run`: its agent serves the store, every rank is a
  // client. false: rank 0 serves it at master_addr:master_port.
  bool launcher_store = false;
  // "cohort run", "torchrun", "Open MPI", "PMI/PMIx (MPICH, Intel MPI)",
  // "Slurm", or "InitOptions" (rank and size given by the caller).
  std::string source;
  // Where master_addr came from, for the INFO log: "MASTER_ADDR",
  // "COHORT_STORE_ADDR", "SLURM_JOB_NODELIST", "single host", ...
  std::string master_addr_from;
  // The variables rank and sizes were read from, for the INFO log:
  // "RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2".
  std::string variables;
};

// Reads the launcher's variables from `env`. Rank and size given by the caller
// (InitOptions) take precedence: both given, no launcher's rank variables are
// read; one given, it stands in for RANK or WORLD_SIZE. Throws InvalidArgument,
// naming the variables, when none are found, when they contradict each other
// (RANK without WORLD_SIZE, rank >= size, ...) or when they are not numbers.
LaunchEnv read_launch_env(const EnvMap& env, std::optional<int> given_rank = std::nullopt,
                          std::optional<int> given_world_size = std::nullopt);

// This process's environment as a map (for read_launch_env).
EnvMap process_env();

// Slurm's compressed host lists: "node[01-04,07],gpu5" -> node01 node02 node03
// node04 node07 gpu5. Zero padding follows the range's first bound; several
// bracket groups in one name multiply ("r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2).
// Throws InvalidArgument (naming `what`, e.g. the variable) on a malformed list.
std::vector<std::string> expand_hostlist(const std::string& list, const std::string& what = "host list");
// The first host of such a list, without expanding the rest.
std::string first_host(const std::string& list, const std::string& what = "host list");

// Slurm's tasks-per-node lists: "2(x3),1" -> 2 2 2 1. Throws InvalidArgument.
std::vector<int> expand_tasks_per_node(const std::string& list, const std::string& what = "SLURM_TASKS_PER_NODE");

}  // namespace cohort::group
