// NativeGroup set-up: who is on which host, which transport reaches each
// peer, shared buffers and sub-groups. (The collectives' entry points are in
// native_group_ops.cpp.)
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "collectives/tuner.hpp"
#include "core/env.hpp"
#include "core/log.hpp"
#include "group/job_settings.hpp"
#include "group/native_group.hpp"
#include "transport/engine.hpp"
#include "transport/registry.hpp"
#include "transport/shared_buffer.hpp"

namespace cohort::group {
namespace {

const core::Knob kSharedBuffers{"COHORT_SHARED_BUFFERS", "1",
                                "ProcessGroup::allocate_buffer (DDP's gradient buckets) returns shared memory that peers "
                                "on this host map once, so that single-copy allreduces on it load and store their bytes "
                                "directly; 0: ordinary memory (those allreduces then copy through process_vm_readv)",
                                core::KnobKind::Bool};

const core::Knob kHostId{"COHORT_HOST_ID", "",
                         "this process's host identity instead of hostname, boot id and network namespace: ranks with "
                         "different ids never use shared memory between them and count as separate hosts for the "
                         "node-aware collectives (as NCCL_HOSTID; for tests and for containers that must not share "
                         "memory)"};

const core::Knob kHostCpus{"COHORT_HOST_CPUS", "",
                          "CPUs the ranks on this host share (set by `cohort run` from its CPU affinity; unset: the "
                          "CPUs online). More ranks on the host than these: waiting ranks yield at once instead of "
                          "spinning (COHORT_SPIN_US)",
                          core::KnobKind::Int};

int host_cpus() {
  if (kHostCpus.is_set()) {
    const int64_t v = kHostCpus.integer();
    if (v < 1)
      throw InvalidArgument(fmt::format("COHORT_HOST_CPUS={} is not a number of CPUs; set it to 1 or more, or unset it "
                                        "to count the CPUs online",
                                        v));
    return static_cast<int>(v);
  }
  return static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
}

// The machine: ranks with the same one share its CPUs, whatever their network
// namespace or COHORT_HOST_ID (hosts that tests make of one machine still
// share its cores).
std::string machine_identity() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  return fmt::format("{}|{}", host, boot);
}

// Ranks with the same identity share /dev/shm and a network stack: same
// hostname, same boot, same network namespace (so that tests with one
// "host" per namespace really use TCP between them).
std::string host_identity() {
  if (!kHostId.str().empty()) return "id|" + kHostId.str();
  char ns[128] = {0};
  ssize_t n = readlink("/proc/self/ns/net", ns, sizeof(ns) - 1);
  return fmt::format("{}|{}", machine_identity(), n > 0 ? std::string(ns, n) : "");
}

// Every rank's host identity, its machine's, and the settings every rank
// must share (job_settings.hpp), by rank: one store key per rank for all three.
struct Identities {
  std::vector<std::string> hosts, machines, settings;
};

Identities exchange_identities(Store& store, int n, int me, const std::string& transport, core::Deadline deadline) {
  store.set_string(fmt::format("host/{}", me),
                   host_identity() + "\n" + machine_identity() + "\n" + job_wide_settings(transport));
  Identities ids;
  for (int r = 0; r < n; ++r) {
    std::string v = store.get_string(fmt::format("host/{}", r), Millis(std::max(1, deadline.remaining_ms())));
    const size_t a = v.find('\n'), b = a == std::string::npos ? a : v.find('\n', a + 1);
    ids.hosts.push_back(v.substr(0, a));
    ids.machines.push_back(a == std::string::npos ? std::string() : v.substr(a + 1, b - a - 1));
    ids.settings.push_back(b == std::string::npos ? std::string() : v.substr(b + 1));
  }
  return ids;
}

}  // namespace

void NativeGroup::connect() {
  const int n = setup_.size, me = setup_.rank;
  auto& store = *setup_.store;
  auto deadline = core::Deadline::after(setup_.timeout);
  conns_.resize(n);
  if (n == 1) {
    engine_ = std::make_unique<transport::Engine>(nullptr, transport::spin_us_for(setup_.host_ranks, host_cpus()));
    comm_ = std::make_unique<collectives::Comm>(0, 1, std::vector<transport::Connection*>(1, nullptr), engine_.get());
    return;
  }
  // COHORT_TRANSPORT names one entry of the table (transport/registry.hpp);
  // unset, every peer gets the first entry that reaches it.
  const std::string pref = setup_.transport;
  const transport::TransportEntry* forced = nullptr;
  if (!pref.empty() && !(forced = transport::find_transport(pref)))
    throw InvalidArgument(fmt::format("COHORT_TRANSPORT={} is not a transport; use one of {} or leave it unset", pref,
                                      transport::transport_names()));

  const Identities ids = exchange_identities(store, n, me, pref, deadline);
  if (std::string why = settings_disagreement(ids.settings, ids.hosts); !why.empty())
    throw InvalidArgument(fmt::format("group {}: {}", setup_.group_id, why));
  const std::vector<std::string>& hosts = ids.hosts;

  // Which entry reaches each peer; the same answer on every rank, since all
  // of them see the same host identities and the same COHORT_TRANSPORT.
  auto reaches = [&](const transport::TransportEntry* e, int r) {
    return e->reach == transport::Reach::AnyHost || hosts[r] == hosts[me];
  };
  std::vector<const transport::TransportEntry*> entry_of(n, nullptr);
  std::vector<int> unreachable;
  for (int r = 0; r < n; ++r) {
    if (r == me) continue;
    if (forced) {
      entry_of[r] = reaches(forced, r) ? forced : nullptr;
    } else {
      for (const transport::TransportEntry* e : transport::transports())
        if (reaches(e, r)) {
          entry_of[r] = e;
          break;
        }
    }
    if (!entry_of[r]) unreachable.push_back(r);
  }
  if (!unreachable.empty())
    throw InvalidArgument(fmt::format("COHORT_TRANSPORT={} reaches only ranks on this host, but ranks {} are on other "
                                      "hosts; unset it to let each peer use the first transport that reaches it ({})",
                                      pref, fmt::join(unreachable, ","), transport::transport_names()));

  // Open each entry that has peers, in table order, and take its connections.
  all_shm_ = true;
  std::vector<std::string> peer_counts;  // "1 peer(s) over shm", per opened entry, for the INFO line
  link_of_.assign(n, -1);
  transport::Waiter* waiter = nullptr;
  std::vector<bool> links_single_copy;  // per entry of links_: its peers allow single copy
  for (const transport::TransportEntry* e : transport::transports()) {
    transport::OpenRequest req{.my_rank = me,
                               .size = n,
                               .world_ranks = setup_.world_ranks,
                               .run_id = setup_.run_id,
                               .group_id = setup_.group_id,
                               .route_hint = setup_.route_hint,
                               .allow_single_copy = thresholds_.allreduce_single_copy_min > 0,
                               .store = &store,
                               .deadline = deadline};
    for (int r = 0; r < n; ++r)
      if (r == me || entry_of[r] == e) req.ranks.push_back(r);
    if (req.ranks.size() < 2) continue;
    auto links = e->open(req);
    for (int r : req.ranks)
      if (r != me) {
        conns_[r] = links->take(r);
        link_of_[r] = static_cast<int>(links_.size());
      }
    if (e->reach != transport::Reach::SameHost) all_shm_ = false;
    const std::string no_single_copy = links->single_copy_unavailable();
    if (single_copy_why_.empty()) single_copy_why_ = no_single_copy;
    links_single_copy.push_back(e->reach == transport::Reach::SameHost && no_single_copy.empty());
    if (!waiter) waiter = links->waiter();
    peer_counts.push_back(fmt::format("{} peer(s) over {}", req.ranks.size() - 1, e->name));
    links_.push_back(std::move(links));
  }
  single_copy_ = single_copy_why_.empty();
  setup_.host_ranks =
      std::max(setup_.host_ranks, static_cast<int>(std::count(ids.machines.begin(), ids.machines.end(), ids.machines[me])));
  const int cpus = host_cpus(), spin_us = transport::spin_us_for(setup_.host_ranks, cpus);
  if (spin_us == 0 && transport::cpus_oversubscribed(setup_.host_ranks, cpus))
    COHORT_INFO(kInit, "group {}: {} ranks on this host share {} CPU(s): a waiting rank yields at once instead of "
                       "spinning (COHORT_SPIN_US, COHORT_HOST_CPUS)",
                setup_.group_id, setup_.host_ranks, cpus);
  engine_ = std::make_unique<transport::Engine>(waiter, spin_us);
  std::vector<transport::Connection*> raw(n, nullptr);
  for (int r = 0; r < n; ++r) raw[r] = conns_[r].get();
  comm_ = std::make_unique<collectives::Comm>(me, n, raw, engine_.get());
  layout_ = collectives::host_layout(hosts, me);
  hier_why_ = collectives::hierarchical_unavailable(layout_);
  if (hier_why_.empty()) {
    auto view = [&](const std::vector<int>& ranks, int my_index) {
      std::vector<transport::Connection*> sub;
      for (int r : ranks) sub.push_back(raw[r]);
      return std::make_unique<collectives::Comm>(my_index, static_cast<int>(ranks.size()), std::move(sub),
                                                 engine_.get());
    };
    local_comm_ = view(layout_.local, layout_.local_index);
    cross_comm_ = view(layout_.cross, layout_.host_index);
    local_single_copy_ = std::all_of(layout_.local.begin(), layout_.local.end(),
                                     [&](int r) { return r == me || (link_of_[r] >= 0 && links_single_copy[link_of_[r]]); });
  }
  COHORT_INFO(kInit, "group {}: rank {}/{} connected: {}", setup_.group_id, me, n, fmt::join(peer_counts, ", "));
  if (core::log_enabled(core::LogLevel::Info, core::kInit)) log_peers(hosts);
  COHORT_INFO(kTuning, "group {}: {}", setup_.group_id,
              collectives::describe_thresholds(thresholds_, n, all_shm_, single_copy_, layout_.hosts,
                                               hier_why_.empty() ? layout_.ranks_per_host : 0));
}

// One INFO line per peer: the transport chosen for it and why, so that "why is
// this slow" starts from facts (a peer on this host over TCP is a misconfigured
// COHORT_TRANSPORT or a different network namespace, ...).
void NativeGroup::log_peers(const std::vector<std::string>& hosts) {
  const int me = setup_.rank;
  const std::string pref = setup_.transport.empty() ? "" : fmt::format(", COHORT_TRANSPORT={}", setup_.transport);
  for (int r = 0; r < setup_.size; ++r) {
    if (r == me) continue;
    const std::string where = hosts[r] == hosts[me] ? "same host" : "other host";
    const transport::Links* links = link_of_[r] >= 0 ? links_[link_of_[r]].get() : nullptr;
    const std::string local = links ? links->local_address() : "";
    if (!local.empty()) {
      const std::string remote = links->peer_address(r);
      COHORT_INFO(kInit, "group {}: peer {} (world rank {}): transport {}, {}{}, {} -> {}", setup_.group_id, r,
                  setup_.world_ranks[r], transport_of(r), where, pref, local, remote.empty() ? "?" : remote);
    } else {
      COHORT_INFO(kInit, "group {}: peer {} (world rank {}): transport {}, {}{}", setup_.group_id, r,
                  setup_.world_ranks[r], transport_of(r), where, pref);
    }
  }
}

std::string NativeGroup::transport_of(int peer) const {
  if (peer == setup_.rank) return "self";
  if (peer < 0 || peer >= setup_.size || !conns_[peer]) return "none";
  return transport::kind_name(conns_[peer]->kind());
}

std::shared_ptr<std::byte[]> NativeGroup::allocate_buffer(size_t bytes) {
  // Only single-copy allreduces (on one host, or on each host of a node-aware one) look at shared
  // buffers: elsewhere one would only cost a descriptor.
  if ((single_copy_ || local_single_copy_) && kSharedBuffers.boolean()) {
    try {
      return transport::allocate_shared_buffer(bytes);
    } catch (const Error& e) {
      COHORT_LOG(Warn, kNet, "group {}: {}; using ordinary memory instead", setup_.group_id, e.what());
    }
  }
  return ProcessGroup::allocate_buffer(bytes);
}

std::shared_ptr<ProcessGroup> NativeGroup::new_group(const std::vector<int>& ranks) {
  std::set<int> seen;
  for (int r : ranks) {
    if (r < 0 || r >= setup_.size)
      throw InvalidArgument(fmt::format("new_group: rank {} is out of range; this group has ranks 0..{}", r, setup_.size - 1));
    if (!seen.insert(r).second) throw InvalidArgument(fmt::format("new_group: rank {} is listed twice", r));
  }
  if (ranks.empty()) throw InvalidArgument("new_group: the list of ranks is empty");
  // Every rank of this group counts new_group calls, members or not, so that
  // the ids agree everywhere.
  const std::string id = fmt::format("{}.{}", setup_.group_id, ++subgroups_);
  auto it = std::find(ranks.begin(), ranks.end(), setup_.rank);
  if (it == ranks.end()) return nullptr;
  GroupSetup s = setup_;
  s.group_id = id;
  s.rank = static_cast<int>(it - ranks.begin());
  s.size = static_cast<int>(ranks.size());
  s.world_ranks.clear();
  for (int r : ranks) s.world_ranks.push_back(setup_.world_ranks[r]);
  s.store = std::make_shared<PrefixStore>("g" + id, setup_.root_store);
  // Every member must pass the same list: each publishes its own (by its rank
  // here) and reads the other members', so a mismatch is named instead of
  // ending in a store timeout deep inside the setup.
  const std::string mine = fmt::format("{}", fmt::join(ranks, ","));
  s.store->set_string(fmt::format("members/{}", setup_.rank), mine);
  for (int r : ranks) {
    if (r == setup_.rank) continue;
    std::string theirs;
    try {
      theirs = s.store->get_string(fmt::format("members/{}", r), setup_.timeout);
    } catch (const TimeoutError&) {
      throw TimeoutError(fmt::format(
          "new_group #{} of group {}: rank {} is in this rank's list [{}] but did not make the same new_group call "
          "within {} ms; HINT: every rank calls new_group in the same order, members or not, with the same list",
          subgroups_, setup_.group_id, r, mine, setup_.timeout.count()));
    }
    if (theirs != mine)
      throw InvalidArgument(fmt::format("new_group #{} of group {}: this rank (rank {}) passed [{}] but rank {} passed "
                                        "[{}]; every rank must pass the same list, in the same order",
                                        subgroups_, setup_.group_id, setup_.rank, mine, r, theirs));
  }
  return NativeGroup::create(std::move(s));
}

}  // namespace cohort::group
