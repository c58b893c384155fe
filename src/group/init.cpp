// init_process_group: read the launcher's environment, reach the store, build the world group.
#include <cstdlib>
#include <random>

#include <fmt/format.h>

#include "cohort/process_group.hpp"
#include "core/env.hpp"
#include "core/log.hpp"
#include "group/native_group.hpp"

namespace cohort {
namespace {

const core::Knob kTimeout{"COHORT_TIMEOUT", "300s",
                          "deadline of every collective and of set-up (e.g. 300s, 30m): a peer that never arrives fails "
                          "the operation after this long",
                          core::KnobKind::Seconds};
const core::Knob kTransport{"COHORT_TRANSPORT", "", "force a transport between ranks: shm (one host only) or tcp; default: "
                                                   "shm between ranks on one host, tcp between hosts"};
const core::Knob kBackend{"COHORT_BACKEND", "native", "collective backend: native (cohort's shm + tcp)"};
const core::Knob kRunId{"COHORT_RUN_ID", "", "job id, set by `cohort run` (names shared-memory segments); made up when unset"};
const core::Knob kStoreAddr{"COHORT_STORE_ADDR", "", "rendezvous store host, set by `cohort run` (default: MASTER_ADDR)"};
const core::Knob kStorePort{"COHORT_STORE_PORT", "", "rendezvous store port, set by `cohort run` (default: MASTER_PORT, "
                                                     "served by rank 0)"};

int env_int(const char* name, std::optional<int> given, const char* hint) {
  if (given) return *given;
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0')
    throw InvalidArgument(fmt::format("{} is not set; {}", name, hint));
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0) throw InvalidArgument(fmt::format("{}={} is not a non-negative integer", name, v));
  return static_cast<int>(x);
}

std::string env_or(const char* name, const char* dflt) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : dflt;
}

}  // namespace

std::shared_ptr<ProcessGroup> init_process_group(InitOptions opts) {
  const char* hint = "start the program with `cohort run` (or torchrun), or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT";
  const int rank = env_int("RANK", opts.rank, hint);
  const int size = env_int("WORLD_SIZE", opts.world_size, hint);
  if (size < 1) throw InvalidArgument(fmt::format("WORLD_SIZE={} must be at least 1", size));
  if (rank >= size) throw InvalidArgument(fmt::format("RANK={} is not below WORLD_SIZE={}", rank, size));
  core::set_log_rank(rank);

  std::string backend = opts.backend == "native" ? kBackend.str() : opts.backend;
  if (backend != "native")
    throw InvalidArgument(fmt::format("backend '{}' is not available in this build; use native (COHORT_BACKEND=native)", backend));

  Millis timeout = opts.timeout.count() > 0 ? opts.timeout : Millis(static_cast<int64_t>(kTimeout.seconds() * 1000));
  std::shared_ptr<Store> base = opts.store;
  std::string route_hint = env_or("MASTER_ADDR", "127.0.0.1");
  if (!base) {
    TcpStoreOptions so;
    so.timeout = timeout;
    so.connect_timeout = timeout;
    if (kStoreAddr.is_set()) {
      so.host = kStoreAddr.str();
      so.port = static_cast<uint16_t>(std::stoi(kStorePort.str()));
      so.is_server = false;
    } else {
      so.host = route_hint;
      so.port = static_cast<uint16_t>(std::stoi(env_or("MASTER_PORT", "29500")));
      so.is_server = rank == 0;
    }
    route_hint = so.host;
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
      root->set_string("run_id", fmt::format("{:08x}", rd()));
    }
    run_id = root->get_string("run_id");
  }

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
  return group::NativeGroup::create(std::move(s));
}

}  // namespace cohort
