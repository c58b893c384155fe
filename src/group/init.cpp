// init_process_group: read the launcher's environment (launch_env.hpp), reach the store, build the world group.
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <random>

#include "cohort/process_group.hpp"
#include "core/cpu_list.hpp"
#include "core/env.hpp"
#include "core/log.hpp"
#include "group/launch_env.hpp"
#include "group/mpi/mpi_group.hpp"
#include "group/native_group.hpp"
#include "group/nccl/nccl_group.hpp"
#include "group/op_timeline.hpp"

namespace cohort {
namespace {

const core::Knob kTimeout{"COHORT_TIMEOUT", "300s",
                          "deadline of every collective and of set-up (e.g. 300s, 30m): a peer that never arrives fails "
                          "the operation after this long",
                          core::KnobKind::Seconds};
const core::Knob kTransport{"COHORT_TRANSPORT", "", "force a transport between ranks: shm (one host only) or tcp; default: "
                                                   "shm between ranks on one host, tcp between hosts"};
const core::Knob kBackend{"COHORT_BACKEND", "native",
                          "collective backend: native (cohort's shm + tcp), mpi (MPI's collectives, under mpirun: "
                          "docs/mpi.md) or nccl (GPU)"};
const core::Knob kRunId{"COHORT_RUN_ID", "", "job id, set by `cohort run` (names shared-memory segments); made up when unset"};
std::string env_or(const char* name, const char* dflt) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : dflt;
}

}  // namespace

std::shared_ptr<ProcessGroup> init_process_group(InitOptions opts) {
  std::string backend = opts.backend == "native" ? kBackend.str() : opts.backend;
  Millis timeout = opts.timeout.count() > 0 ? std::min(opts.timeout, core::kLongestWait) : kTimeout.millis();
  if (timeout.count() == 0)
    throw InvalidArgument(fmt::format("COHORT_TIMEOUT={} would time out every operation at once; use a positive "
                                      "duration such as 300s (the default), or a very large one to wait as long as it "
                                      "takes",
                                      kTimeout.str()));
  // MPI knows rank and size itself and needs no store (group/mpi/, docs/mpi.md).
  if (backend == "mpi") return group::create_mpi_group(opts.rank, opts.world_size, timeout);
  // torchrun's, cohort run's, Open MPI's, PMI's or Slurm's variables (group/launch_env.hpp).
  const group::LaunchEnv le = group::read_launch_env(group::process_env(), opts.rank, opts.world_size);
  const int rank = le.rank;
  const int size = le.world_size;
  core::set_log_rank(rank);
  COHORT_INFO(kInit, "rank {} of {} (local rank {} of {}) from {}'s variables ({}); store host {} ({})", rank, size,
              le.local_rank ? std::to_string(*le.local_rank) : "?",
              le.local_world_size ? std::to_string(*le.local_world_size) : "?", le.source, le.variables,
              le.master_addr, le.master_addr_from);
  COHORT_INFO(kInit, "host {}: {}", le.local_world_size ? fmt::format("with {} local rank(s)", *le.local_world_size)
                                                        : std::string("seen"),
              core::describe_affinity(core::current_affinity()));

  if (backend != "native" && backend != "nccl")
    throw InvalidArgument(
        fmt::format("backend '{}' is unknown; use native, mpi or nccl (COHORT_BACKEND or InitOptions::backend)", backend));

  std::shared_ptr<Store> base = opts.store;
  std::string route_hint = le.master_addr;
  if (!base) {
    TcpStoreOptions so;
    so.timeout = timeout;
    so.connect_timeout = timeout;
    so.host = le.master_addr;
    so.port = static_cast<uint16_t>(le.master_port);
    so.is_server = !le.launcher_store && rank == 0;
    COHORT_INFO(kInit, "store {}:{}{}", so.host, so.port, so.is_server ? " (served by this rank)" : "");
    base = std::make_shared<TcpStore>(so);
    base->set_timeout(timeout);
  }

  // Keys of one attempt of an elastic job must not meet those of the next.
  const std::string attempt = env_or("TORCHELASTIC_RESTART_COUNT", "0");
  // Our own prefix store carries our timeout; a store the caller passed in
  // (maybe shared by threads) is left untouched.
  auto root = std::make_shared<PrefixStore>("cohort/" + attempt, base);
  root->set_timeout(timeout);
  std::string run_id = kRunId.str();
  if (run_id.empty()) {
    if (rank == 0) {
      std::random_device rd;
      root->set_string("run_id", fmt::format("{:08x}{:08x}", rd(), rd()));  // 64 bits: names shm segments
    }
    run_id = root->get_string("run_id");
  }
  group::timeline_setup(*root, rank, size);  // COHORT_TIMELINE: clock offsets (no-op when off)

  group::GroupSetup s;
  s.rank = rank;
  s.size = size;
  for (int r = 0; r < size; ++r) s.world_ranks.push_back(r);
  s.root_store = root;
  s.store = std::make_shared<PrefixStore>("g0", root);
  s.group_id = std::string(1, '0');  // (not = "0": GCC 12 -Wrestrict false positive, PR 105329)
  s.run_id = run_id;
  s.timeout = timeout;
  s.transport = opts.transport.empty() ? kTransport.str() : opts.transport;
  s.route_hint = route_hint;
  s.host_ranks = le.local_world_size.value_or(0);
  if (backend == "nccl") return group::create_nccl_group(s, le.local_rank);
  return group::NativeGroup::create(std::move(s));
}

}  // namespace cohort
