#include "collectives/tuner.hpp"

#include <sstream>
#include <vector>

#include <fmt/format.h>

#include "cohort/error.hpp"
#include "core/env.hpp"

namespace cohort::collectives {
namespace {

const core::Knob kAlgo{"COHORT_ALGO", "",
                       "force algorithms: one name for every collective that has it (ring, recursive_doubling, binomial, "
                       "pipeline, direct, single_copy, hierarchical), or a list like allreduce=ring,broadcast=binomial"};
const core::Knob kSingleCopyBytes{
    "COHORT_SINGLE_COPY_BYTES", "1M",
    "allreduces and allgathers (output in all) of at least this many bytes use single copy (process_vm_readv/writev "
    "between ranks of one host, one copy per byte) when every peer is on this host and the kernel allows it; 0: "
    "never (for every collective)",
    core::KnobKind::Bytes};
const core::Knob kSingleCopySharedBytes{
    "COHORT_SINGLE_COPY_SHARED_BYTES", "256K",
    "allreduces and allgathers (in all) from this many bytes up to COHORT_SINGLE_COPY_BYTES, and reduce_scatters "
    "from this many bytes up, use single copy when every rank's buffers are shared buffers "
    "(ProcessGroup::allocate_buffer, as DDP's buckets), the ring otherwise; 0: never",
    core::KnobKind::Bytes};
const core::Knob kHierarchical{
    "COHORT_HIERARCHICAL", "1",
    "on groups spread over 2 or more hosts with as many ranks (at least 2) on each, allreduces above 64 KiB, "
    "reduce_scatters, allgathers and broadcasts that would run a ring or chain run node-aware: each block crosses "
    "between hosts once, among the ranks of one local rank (docs/algorithms.md); 0: the flat algorithms",
    core::KnobKind::Bool};

// Which algorithms can run which collective.
bool supports(Coll c, Algo a) {
  switch (c) {
    case Coll::Allreduce:
      return a == Algo::Ring || a == Algo::RecursiveDoubling || a == Algo::SingleCopy || a == Algo::Hierarchical;
    case Coll::Broadcast: return a == Algo::Binomial || a == Algo::Pipeline || a == Algo::Hierarchical;
    case Coll::Reduce: return a == Algo::Binomial;
    case Coll::Allgather:
      return a == Algo::Ring || a == Algo::Direct || a == Algo::SingleCopy || a == Algo::Hierarchical;
    case Coll::ReduceScatter: return a == Algo::Ring || a == Algo::SingleCopy || a == Algo::Hierarchical;
    case Coll::Gather:
    case Coll::Scatter: return a == Algo::Linear;
    case Coll::Alltoall: return a == Algo::Direct;
    case Coll::Barrier: return a == Algo::Dissemination;
    case Coll::Send:
    case Coll::Recv:
    case Coll::P2PBatch: return a == Algo::Direct;
  }
  return false;
}

}  // namespace

const char* coll_name(Coll c) {
  switch (c) {
    case Coll::Allreduce: return "allreduce";
    case Coll::Broadcast: return "broadcast";
    case Coll::Reduce: return "reduce";
    case Coll::Allgather: return "allgather";
    case Coll::ReduceScatter: return "reduce_scatter";
    case Coll::Gather: return "gather";
    case Coll::Scatter: return "scatter";
    case Coll::Alltoall: return "alltoall";
    case Coll::Barrier: return "barrier";
    case Coll::Send: return "send";
    case Coll::Recv: return "recv";
    case Coll::P2PBatch: return "batch_isend_irecv";
  }
  return "?";
}

const char* algo_name(Algo a) {
  switch (a) {
    case Algo::Ring: return "ring";
    case Algo::RecursiveDoubling: return "recursive_doubling";
    case Algo::Binomial: return "binomial";
    case Algo::Pipeline: return "pipeline";
    case Algo::Direct: return "direct";
    case Algo::Linear: return "linear";
    case Algo::Dissemination: return "dissemination";
    case Algo::SingleCopy: return "single_copy";
    case Algo::Hierarchical: return "hierarchical";
  }
  return "?";
}

std::optional<Algo> parse_algo(const std::string& s) {
  if (s == "ring") return Algo::Ring;
  if (s == "recursive_doubling" || s == "rd") return Algo::RecursiveDoubling;
  if (s == "binomial" || s == "tree") return Algo::Binomial;
  if (s == "pipeline" || s == "chain") return Algo::Pipeline;
  if (s == "direct") return Algo::Direct;
  if (s == "linear") return Algo::Linear;
  if (s == "dissemination") return Algo::Dissemination;
  if (s == "single_copy") return Algo::SingleCopy;
  if (s == "hierarchical" || s == "hier") return Algo::Hierarchical;
  return std::nullopt;
}

std::optional<Coll> parse_coll(const std::string& s) {
  for (Coll c : {Coll::Allreduce, Coll::Broadcast, Coll::Reduce, Coll::Allgather, Coll::ReduceScatter, Coll::Gather,
                 Coll::Scatter, Coll::Alltoall, Coll::Barrier, Coll::Send, Coll::Recv, Coll::P2PBatch})
    if (s == coll_name(c)) return c;
  return std::nullopt;
}

namespace {
bool single_copy_shared(const TunerInput& in, size_t total, const Thresholds& t) {
  return in.single_copy && t.allreduce_single_copy_min > 0 && t.allreduce_single_copy_shared_min > 0 &&
         total >= t.allreduce_single_copy_shared_min;
}
// Single copy on any buffers (from allreduce_single_copy_min) or, from the shared-buffer threshold, where
// the group finds every rank's buffers shared (single_copy_shared_only says which).
bool single_copy_any(const TunerInput& in, size_t total, const Thresholds& t) {
  return single_copy_shared(in, total, t) ||
         (in.single_copy && t.allreduce_single_copy_min > 0 && total >= t.allreduce_single_copy_min);
}
}  // namespace

Algo choose(const TunerInput& in, const Thresholds& t) {
  // Several hosts with as many ranks on each: the node-aware algorithms where
  // the flat choice would be a ring or chain (they send each block across
  // hosts once, in (H-1) + (L-1) steps instead of n-1).
  const bool hier = t.hierarchical && in.hosts > 1 && in.ranks_per_host > 1;
  switch (in.coll) {
    case Coll::Allreduce:
      if (single_copy_any(in, in.bytes, t))
        return Algo::SingleCopy;  // below allreduce_single_copy_min only with shared buffers: the ring otherwise
      if (in.bytes <= (in.all_shm ? t.allreduce_rd_max_shm : t.allreduce_rd_max_tcp)) return Algo::RecursiveDoubling;
      return hier ? Algo::Hierarchical : Algo::Ring;
    case Coll::Broadcast:
      if (in.nranks <= 2 || in.bytes <= t.broadcast_binomial_max) return Algo::Binomial;
      return hier ? Algo::Hierarchical : Algo::Pipeline;
    case Coll::Reduce: return Algo::Binomial;
    // Single copy from the shared-buffer threshold of allreduce, on the whole
    // buffer; on ordinary memory (single_copy_shared_only) only allgathers from
    // allreduce_single_copy_min, else the ring, where it measured faster.
    case Coll::Allgather:  // in.bytes is one rank's block
      if (single_copy_any(in, in.bytes * static_cast<size_t>(in.nranks), t)) return Algo::SingleCopy;
      if (in.nranks <= 8 && in.bytes <= t.allgather_direct_max) return Algo::Direct;
      return hier ? Algo::Hierarchical : Algo::Ring;
    case Coll::ReduceScatter:  // in.bytes is the whole input
      if (single_copy_shared(in, in.bytes, t)) return Algo::SingleCopy;
      return hier ? Algo::Hierarchical : Algo::Ring;
    case Coll::Gather:
    case Coll::Scatter: return Algo::Linear;
    case Coll::Alltoall: return Algo::Direct;
    case Coll::Barrier: return Algo::Dissemination;
    case Coll::Send:
    case Coll::Recv:
    case Coll::P2PBatch: return Algo::Direct;
  }
  return Algo::Direct;
}

std::optional<Algo> override_from_env(Coll c, const std::string& spec) {
  if (spec.empty()) return std::nullopt;
  std::stringstream ss(spec);
  std::string item;
  std::optional<Algo> result;
  while (std::getline(ss, item, ',')) {
    std::string coll, name = item;
    auto eq = item.find('=');
    if (eq != std::string::npos) {
      coll = item.substr(0, eq);
      name = item.substr(eq + 1);
    }
    auto a = parse_algo(name);
    if (!a)
      throw InvalidArgument(fmt::format("COHORT_ALGO: unknown algorithm '{}'; use ring, recursive_doubling, binomial, "
                                        "pipeline, direct, single_copy or hierarchical",
                                        name));
    if (!coll.empty()) {
      if (coll != coll_name(c)) continue;
      if (!supports(c, *a))
        throw InvalidArgument(fmt::format("COHORT_ALGO: {} cannot run {}", algo_name(*a), coll_name(c)));
      result = a;
    } else if (supports(c, *a)) {
      result = a;  // a bare name applies to every collective that has it
    }
  }
  return result;
}

namespace {
std::string kib(size_t b) { return b % 1024 == 0 ? fmt::format("{} KiB", b / 1024) : fmt::format("{} B", b); }
}  // namespace

Thresholds thresholds_from_env() {
  Thresholds t;
  t.allreduce_single_copy_min = kSingleCopyBytes.bytes();
  t.allreduce_single_copy_shared_min = kSingleCopySharedBytes.bytes();
  t.hierarchical = kHierarchical.boolean();
  return t;
}

bool single_copy_shared_only(Coll c, size_t total_bytes, const Thresholds& t) {
  return c == Coll::ReduceScatter || total_bytes < t.allreduce_single_copy_min;
}

std::string describe_thresholds(const Thresholds& t, int nranks, bool all_shm, bool single_copy, int hosts,
                                int ranks_per_host) {
  const size_t rd = all_shm ? t.allreduce_rd_max_shm : t.allreduce_rd_max_tcp;
  const std::string above =
      single_copy && t.allreduce_single_copy_min > 0
          ? fmt::format("ring above, single_copy from {}{}", kib(t.allreduce_single_copy_min),
                        t.allreduce_single_copy_shared_min > 0 && t.allreduce_single_copy_shared_min < t.allreduce_single_copy_min
                            ? fmt::format(" (from {} when every rank's buffers are shared)",
                                          kib(t.allreduce_single_copy_shared_min))
                            : std::string())
          : std::string("ring above");
  const std::string gs_single_copy =
      single_copy && t.allreduce_single_copy_min > 0 && t.allreduce_single_copy_shared_min > 0
          ? fmt::format(", single_copy from {} in all when every rank's buffers are shared",
                        kib(t.allreduce_single_copy_shared_min))
          : std::string();
  const std::string ag_single_copy =
      single_copy && t.allreduce_single_copy_min > 0
          ? fmt::format("{}, single_copy from {} in all on any buffers", gs_single_copy, kib(t.allreduce_single_copy_min))
          : gs_single_copy;
  std::string s = fmt::format(
      "tuner thresholds for {} ranks ({}): allreduce recursive_doubling up to {}, {}; broadcast binomial up "
      "to {}{}, pipeline above; allgather {}{}; reduce_scatter ring{}; reduce binomial",
      nranks, all_shm ? "all peers over shm" : "some peers over tcp", kib(rd), above, kib(t.broadcast_binomial_max),
      nranks <= 2 ? " (always with 2 ranks)" : "",
      nranks <= 8 ? fmt::format("direct up to {} per rank, ring above", kib(t.allgather_direct_max))
                  : std::string("ring (more than 8 ranks)"),
      ag_single_copy, gs_single_copy);
  if (t.hierarchical && hosts > 1 && ranks_per_host > 1)
    s += fmt::format("; {} hosts of {} ranks: hierarchical where the flat choice is a ring or chain (allreduce "
                     "above {}, reduce_scatter, allgather above the direct sizes, broadcast above {})",
                     hosts, ranks_per_host, kib(t.allreduce_rd_max_tcp), kib(t.broadcast_binomial_max));
  const std::string spec = kAlgo.str();
  if (!spec.empty()) s += fmt::format("; overridden by COHORT_ALGO={}", spec);
  return s;
}

namespace {
const std::string& algo_spec() {
  static const std::string spec = kAlgo.str();  // read once per process
  return spec;
}
}  // namespace

std::optional<Algo> forced_algo(Coll c) { return override_from_env(c, algo_spec()); }

}  // namespace cohort::collectives
