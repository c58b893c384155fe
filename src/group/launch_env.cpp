// read_launch_env: which launcher started us, and where this rank sits (see launch_env.hpp).
#include "group/launch_env.hpp"

#include <algorithm>
#include <charconv>
#include <string_view>

#include <fmt/format.h>

#include "cohort/error.hpp"
#include "core/env.hpp"

extern char** environ;

namespace cohort::group {
namespace {

const core::Knob kStoreAddr{"COHORT_STORE_ADDR", "", "rendezvous store host, set by `cohort run` (default: MASTER_ADDR)"};
const core::Knob kStorePort{"COHORT_STORE_PORT", "", "rendezvous store port, set by `cohort run` (default: MASTER_PORT, "
                                                     "served by rank 0)"};

const char* const kHowToStart =
    "start the program with `cohort run` or torchrun, with mpirun / mpiexec, or with srun; or set RANK, WORLD_SIZE, "
    "MASTER_ADDR and MASTER_PORT yourself";

// Rank and size as one launcher reported them.
struct Place {
  int rank = 0;
  int size = 1;
  std::optional<int> local_rank, local_size;
  std::string source;
  std::string rank_var, size_var, local_rank_var, local_size_var;  // for error messages
};

std::optional<std::string> get(const EnvMap& env, const std::string& name) {
  auto it = env.find(name);
  if (it == env.end() || it->second.empty()) return std::nullopt;
  return it->second;
}

int to_int(const std::string& value, const std::string& name) {
  int v = 0;
  auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (ec != std::errc() || end != value.data() + value.size() || v < 0)
    throw InvalidArgument(fmt::format("{}='{}' is not a non-negative integer; fix or unset it", name, value));
  return v;
}

std::optional<int> get_int(const EnvMap& env, const std::string& name) {
  auto v = get(env, name);
  return v ? std::optional<int>(to_int(*v, name)) : std::nullopt;
}

// The first of `names` that is set, as {name, value}.
std::optional<std::pair<std::string, std::string>> first_set(const EnvMap& env, std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (auto v = get(env, n)) return std::make_pair(std::string(n), *v);
  return std::nullopt;
}

// A launcher's rank and size variable come together: one without the other
// means the environment is half one launcher's, or hand-edited.
std::optional<Place> rank_and_size(const EnvMap& env, const std::string& rank_var,
                                   std::initializer_list<const char*> size_vars, const std::string& source) {
  auto rank = get_int(env, rank_var);
  auto size_kv = first_set(env, size_vars);
  if (!rank && !size_kv) return std::nullopt;
  const std::string size_var = *size_vars.begin();
  if (!rank)
    throw InvalidArgument(fmt::format("{} is set ({}) but {} is not: {}'s variables come together. Set both, or unset "
                                      "{} to let another launcher's variables decide",
                                      size_kv->first, size_kv->second, rank_var, source, size_kv->first));
  if (!size_kv)
    throw InvalidArgument(fmt::format("{} is set ({}) but {} is not: {}'s variables come together. Set both, or unset "
                                      "{} to let another launcher's variables decide",
                                      rank_var, *rank, size_var, source, rank_var));
  Place p;
  p.rank = *rank;
  p.size = to_int(size_kv->second, size_kv->first);
  p.source = source;
  p.rank_var = rank_var;
  p.size_var = size_kv->first;
  return p;
}

void read_local(const EnvMap& env, Place& p, const char* local_rank_var, const char* local_size_var) {
  p.local_rank = get_int(env, local_rank_var);
  p.local_size = get_int(env, local_size_var);
  p.local_rank_var = local_rank_var;
  p.local_size_var = local_size_var;
}

std::optional<Place> from_torchrun(const EnvMap& env) {
  auto p = rank_and_size(env, "RANK", {"WORLD_SIZE"}, "torchrun");
  if (!p) return p;
  if (get(env, kStoreAddr.name())) p->source = "cohort run";
  read_local(env, *p, "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  return p;
}

std::optional<Place> from_open_mpi(const EnvMap& env) {
  auto p = rank_and_size(env, "OMPI_COMM_WORLD_RANK", {"OMPI_COMM_WORLD_SIZE"}, "Open MPI");
  if (p) read_local(env, *p, "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE");
  return p;
}

// MPICH's Hydra and Intel MPI's mpiexec.
std::optional<Place> from_pmi(const EnvMap& env) {
  // PMI_SIZE beside PMIX_RANK (no PMI_RANK) belongs to PMIx: see from_pmix.
  if (!get(env, "PMI_RANK") && get(env, "PMIX_RANK")) return std::nullopt;
  auto p = rank_and_size(env, "PMI_RANK", {"PMI_SIZE"}, "PMI/PMIx (MPICH, Intel MPI)");
  if (p) read_local(env, *p, "MPI_LOCALRANKID", "MPI_LOCALNRANKS");
  return p;
}

// Ranks on this node under srun: the step's tasks-per-node list at this
// node's index, else --ntasks-per-node, else the list when it is uniform.
std::optional<int> slurm_local_size(const EnvMap& env) {
  auto list = first_set(env, {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"});
  std::vector<int> counts;
  if (list) counts = expand_tasks_per_node(list->second, list->first);
  auto node = get_int(env, "SLURM_NODEID");
  if (node && static_cast<size_t>(*node) < counts.size()) return counts[*node];
  if (auto n = get_int(env, "SLURM_NTASKS_PER_NODE")) return n;
  if (!counts.empty() && std::all_of(counts.begin(), counts.end(), [&](int c) { return c == counts[0]; }))
    return counts[0];
  return std::nullopt;
}

std::optional<Place> from_slurm(const EnvMap& env) {
  auto p = rank_and_size(env, "SLURM_PROCID", {"SLURM_NTASKS", "SLURM_NPROCS"}, "Slurm");
  if (!p) return p;
  p->local_rank = get_int(env, "SLURM_LOCALID");
  p->local_size = slurm_local_size(env);
  p->local_rank_var = "SLURM_LOCALID";
  p->local_size_var = "SLURM_TASKS_PER_NODE";
  return p;
}

// PMIx publishes the rank but not the size in the environment.
std::optional<Place> from_pmix(const EnvMap& env) {
  auto rank = get_int(env, "PMIX_RANK");
  if (!rank) return std::nullopt;
  if (!get(env, "PMI_SIZE"))
    throw InvalidArgument(fmt::format(
        "PMIX_RANK is set ({}) but no variable gives the number of ranks (PMI_SIZE, OMPI_COMM_WORLD_SIZE or "
        "SLURM_NTASKS): set PMI_SIZE, or RANK=$PMIX_RANK and WORLD_SIZE yourself (and MASTER_ADDR when ranks span "
        "hosts)",
        *rank));
  Place p;
  p.rank = *rank;
  p.size = to_int(*get(env, "PMI_SIZE"), "PMI_SIZE");
  p.source = "PMI/PMIx (MPICH, Intel MPI)";
  p.rank_var = "PMIX_RANK";
  p.size_var = "PMI_SIZE";
  read_local(env, p, "MPI_LOCALRANKID", "MPI_LOCALNRANKS");
  return p;
}

void check(const Place& p) {
  if (p.size < 1)
    throw InvalidArgument(fmt::format("{}={} (from {}): the world size must be at least 1", p.size_var, p.size, p.source));
  if (p.rank >= p.size)
    throw InvalidArgument(fmt::format("{}={} is not below {}={} (from {}): ranks run from 0 to size - 1; the variables "
                                      "contradict each other (set by hand, or left over from another launcher?)",
                                      p.rank_var, p.rank, p.size_var, p.size, p.source));
  if (p.local_size && *p.local_size > p.size)
    throw InvalidArgument(fmt::format("{}={} is above {}={} (from {}): more ranks on this host than in the job",
                                      p.local_size_var, *p.local_size, p.size_var, p.size, p.source));
  if (p.local_rank && p.local_size && *p.local_rank >= *p.local_size)
    throw InvalidArgument(fmt::format("{}={} is not below {}={} (from {})", p.local_rank_var, *p.local_rank,
                                      p.local_size_var, *p.local_size, p.source));
}

Place find_place(const EnvMap& env, std::optional<int> given_rank, std::optional<int> given_size) {
  if (given_rank && given_size) {
    Place p;
    p.rank = *given_rank;
    p.size = *given_size;
    p.source = "InitOptions";
    p.rank_var = "InitOptions::rank";
    p.size_var = "InitOptions::world_size";
    return p;
  }
  if (given_rank || given_size) {  // one given: it stands in for torchrun's variable
    EnvMap with = env;
    with[given_rank ? "RANK" : "WORLD_SIZE"] = std::to_string(given_rank ? *given_rank : *given_size);
    return *from_torchrun(with);
  }
  using Reader = std::optional<Place> (*)(const EnvMap&);
  const Reader readers[] = {from_torchrun, from_open_mpi, from_pmi, from_slurm, from_pmix};  // precedence: see header
  for (Reader reader : readers)
    if (auto p = reader(env)) return *p;
  throw InvalidArgument(fmt::format("cannot tell this process's rank: none of RANK (torchrun, cohort run), "
                                    "OMPI_COMM_WORLD_RANK (Open MPI), PMI_RANK (MPICH, Intel MPI), SLURM_PROCID (srun) "
                                    "or PMIX_RANK is set; {}",
                                    kHowToStart));
}

int parse_port(const std::string& value, const std::string& name) {
  int port = to_int(value, name);
  if (port < 1 || port > 65535)
    throw InvalidArgument(fmt::format("{}={} is not a TCP port (1-65535)", name, value));
  return port;
}

}  // namespace

LaunchEnv read_launch_env(const EnvMap& env, std::optional<int> given_rank, std::optional<int> given_world_size) {
  Place p = find_place(env, given_rank, given_world_size);
  check(p);
  LaunchEnv le;
  le.rank = p.rank;
  le.world_size = p.size;
  le.local_rank = p.local_rank;
  le.local_world_size = p.local_size;
  le.source = p.source;
  le.variables = fmt::format("{}={} {}={}", p.rank_var.empty() ? "rank" : p.rank_var, p.rank,
                             p.size_var.empty() ? "size" : p.size_var, p.size);
  if (p.local_rank) le.variables += fmt::format(" {}={}", p.local_rank_var.empty() ? "local rank" : p.local_rank_var, *p.local_rank);
  if (p.local_size)
    le.variables += fmt::format(" {}={}", p.local_size_var.empty() ? "local size" : p.local_size_var, *p.local_size);

  if (auto store = get(env, kStoreAddr.name())) {  // `cohort run`'s agent serves the store
    auto port = get(env, kStorePort.name());
    if (!port)
      throw InvalidArgument("COHORT_STORE_ADDR is set but COHORT_STORE_PORT is not: `cohort run` sets both; unset "
                            "COHORT_STORE_ADDR when starting the program another way");
    le.master_addr = *store;
    le.master_addr_from = "COHORT_STORE_ADDR";
    le.master_port = parse_port(*port, "COHORT_STORE_PORT");
    le.launcher_store = true;
    return le;
  }
  if (auto port = get(env, "MASTER_PORT")) le.master_port = parse_port(*port, "MASTER_PORT");

  const bool one_host = le.world_size == 1 || (le.local_world_size && *le.local_world_size == le.world_size);
  auto nodelist = first_set(env, {"SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"});
  if (auto addr = get(env, "MASTER_ADDR")) {
    le.master_addr = *addr;
    le.master_addr_from = "MASTER_ADDR";
  } else if (one_host) {
    le.master_addr = "127.0.0.1";
    le.master_addr_from = "single host";
  } else if (nodelist) {
    le.master_addr = first_host(nodelist->second, nodelist->first);
    le.master_addr_from = "first host of " + nodelist->first;
  } else if (!le.local_world_size && (p.source == "torchrun" || p.source == "InitOptions")) {
    // RANK / WORLD_SIZE set by hand, as cohort has always accepted: one host.
    le.master_addr = "127.0.0.1";
    le.master_addr_from = "default (MASTER_ADDR unset)";
  } else {
    std::string where = le.local_world_size
                            ? fmt::format("{} of its {} ranks run on this host", *le.local_world_size, le.world_size)
                            : fmt::format("it did not say how many of its {} ranks run on this host", le.world_size);
    throw InvalidArgument(fmt::format(
        "rank {}: started by {}, and {}, but MASTER_ADDR is not set, so this rank cannot tell where rank 0 serves the "
        "store. Set MASTER_ADDR to rank 0's host for every rank: e.g. `export MASTER_ADDR=$(hostname) "
        "MASTER_PORT=29500` on the host that starts rank 0, then `mpirun -x MASTER_ADDR -x MASTER_PORT ...` (MPICH / "
        "Intel MPI: `mpiexec -genv MASTER_ADDR $(hostname) ...`)",
        le.rank, le.source, where));
  }
  return le;
}

EnvMap process_env() {
  EnvMap env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string_view kv(*e);
    size_t eq = kv.find('=');
    if (eq == std::string_view::npos) continue;
    env.emplace(std::string(kv.substr(0, eq)), std::string(kv.substr(eq + 1)));
  }
  return env;
}

}  // namespace cohort::group
