// The tuner: which algorithm runs a collective, as a pure function of the
// collective, message size, group size and transport mix (so tests can call
// it directly). COHORT_ALGO overrides it. Thresholds and the measurements
// behind them: docs/algorithms.md.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

namespace cohort::collectives {

enum class Coll { Allreduce, Broadcast, Reduce, Allgather, ReduceScatter, Gather, Scatter, Alltoall, Barrier, Send, Recv, P2PBatch };
const char* coll_name(Coll c);

enum class Algo { Ring, RecursiveDoubling, Binomial, Pipeline, Direct, Linear, Dissemination, SingleCopy, Hierarchical };
const char* algo_name(Algo a);
// The names algo_name and coll_name give (and the aliases COHORT_ALGO takes: rd, tree, chain, hier).
std::optional<Algo> parse_algo(const std::string& s);
std::optional<Coll> parse_coll(const std::string& s);

struct TunerInput {
  Coll coll;
  size_t bytes;    // per-rank buffer bytes (allreduce, broadcast, reduce); per-rank block (allgather, ...)
  int nranks;
  bool all_shm;    // every peer is on this host over shared memory
  bool single_copy = false;  // ... and ranks may access each other's memory (ShmTransport::single_copy)
  // The host layout (host_layout.hpp): distinct hosts, and the ranks on each
  // when every host has as many (over shared memory among themselves), else 0.
  int hosts = 1;
  int ranks_per_host = 0;
};

struct Thresholds {
  size_t allreduce_rd_max_shm = 16 * 1024;   // recursive doubling up to here, ring above
  size_t allreduce_rd_max_tcp = 64 * 1024;
  size_t broadcast_binomial_max = 256 * 1024;
  size_t allgather_direct_max = 32 * 1024;   // per-rank block, and only for nranks <= 8
  size_t allreduce_single_copy_min = 1 << 20;  // single copy from here up, when the group has it (0: never)
  // From here up to allreduce_single_copy_min, single copy when every rank's
  // buffers are shared buffers (ProcessGroup::allocate_buffer; the ranks find
  // out when they swap addresses), else the ring (0: never).
  size_t allreduce_single_copy_shared_min = 256 << 10;
  // On several hosts with 2 or more ranks each: the node-aware algorithms
  // where the flat choice would be a ring or chain (false: never).
  bool hierarchical = true;
};

// The defaults with COHORT_SINGLE_COPY_BYTES and COHORT_SINGLE_COPY_SHARED_BYTES applied (read at every call: a
// group reads it once, when it is made).
Thresholds thresholds_from_env();

// Where the tuner chose SingleCopy (and COHORT_ALGO did not force it): true
// when it runs only if every rank's buffers are shared buffers, the ring
// otherwise. Allreduce and allgather below allreduce_single_copy_min (of
// total_bytes: the buffer, the whole output); reduce_scatter always.
bool single_copy_shared_only(Coll c, size_t total_bytes, const Thresholds& t);

// The default choice.
Algo choose(const TunerInput& in, const Thresholds& t = Thresholds{});

// Parses COHORT_ALGO ("ring", "allreduce=ring,broadcast=binomial", ...) for one
// collective. nullopt: no override. Throws InvalidArgument for unknown names or
// an algorithm that cannot run this collective.
std::optional<Algo> override_from_env(Coll c, const std::string& spec);

// The thresholds as the INFO log prints them at group set-up, with what the
// tuner will pick for a group of `nranks` and any COHORT_ALGO override:
// "tuner: allreduce recursive_doubling up to 16 KiB (this group: all shm), ring above; ...".
std::string describe_thresholds(const Thresholds& t, int nranks, bool all_shm, bool single_copy = false,
                                int hosts = 1, int ranks_per_host = 0);

// The algorithm COHORT_ALGO (read once per process) names for this
// collective, if any; otherwise the group calls choose().
std::optional<Algo> forced_algo(Coll c);

}  // namespace cohort::collectives
