#include "plan/collective_time.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include "cohort/error.hpp"

namespace cohort::plan {
namespace {

std::string class_list(const CostTable& t) {
  std::string s;
  for (const auto& [cls, costs] : t.classes) s += std::string(s.empty() ? "" : ", ") + link_class_name(cls);
  return s.empty() ? "none" : s;
}

std::string how_to_measure(LinkClass cls) {
  switch (cls) {
    case LinkClass::Shm: return "`cohort run --nproc-per-node N cohort bench --calibrate FILE` on one host";
    case LinkClass::TcpLocal:
      return "`COHORT_TRANSPORT=tcp cohort run --nproc-per-node N cohort bench --calibrate FILE` on one host";
    case LinkClass::TcpCross:
      return "`cohort bench --calibrate FILE` under `cohort run` on 2 or more hosts with one rank per host (or give the "
             "link's speed with --inter-host-gbps)";
    case LinkClass::NcclLocal:
    case LinkClass::NcclCross:
      return "the link speeds (--intra-host-gbps, --inter-host-gbps) or a --cluster preset (calibrating NCCL is not "
             "written yet)";
  }
  return "";
}

class Predictor {
 public:
  Predictor(const CostTable& t, const GroupShape& g, const collectives::Thresholds& th) : t_(t), g_(g), th_(th) {}

  // One algorithm of one collective among n ranks on one class; `flows` of
  // them share each host's link when the class crosses hosts. `alone`: these
  // n ranks run as a calibration run would (one host, or one rank per host),
  // so where the class was measured at this group its samples give the time.
  double flat(LinkClass cls, Coll c, Algo a, double bytes, int n, int flows, bool alone, std::string& how) const {
    if (n <= 1) return 0;
    auto it = t_.classes.find(cls);
    if (it == t_.classes.end())
      throw InvalidArgument(fmt::format("{} has no link class '{}' (it has: {}), and this prediction needs it; measure it "
                                        "with {}",
                                        t_.source, link_class_name(cls), class_list(t_), how_to_measure(cls)));
    const AlgoCost* cost = it->second.find(algo_key(c, a), bytes);
    if (cost == nullptr)
      throw InvalidArgument(fmt::format("{}: link class '{}' has no measurements of {} at any group size, and a group "
                                        "of {} runs it here; calibrate that class at {} ranks too (the tuner picks "
                                        "it there)",
                                        t_.source, link_class_name(cls), algo_key(c, a), n, n));
    const Shape s = algo_shape(c, a, bytes, n);
    const int cores = g_.cores_per_host > 0 ? g_.cores_per_host : std::max(1, it->second.cores);
    const int machine_ranks = g_.same_machine ? g_.nranks() : g_.ranks_per_host;
    // A measured group's times hold on the machine it was measured on (its cores).
    const bool same_cores = g_.cores_per_host <= 0 || g_.cores_per_host == it->second.cores;
    const std::optional<double> seen =
        alone && same_cores ? it->second.at_measured_group(algo_key(c, a), bytes, n, machine_ranks) : std::nullopt;
    double us = seen ? *seen : cost_us(*cost, s, Contention{machine_ranks, cores});
    if (cls == LinkClass::TcpCross && g_.cross_gbps > 0) {
      // TCP's payload is 1448 bytes of the 1538 a full Ethernet frame takes on the line (MTU 1500 with
      // TCP timestamps; header 14, FCS 4, preamble 8, gap 12): 0.94 of the line rate.
      const double payload = 1448.0 / 1538;
      const double wire_us = s.steps * cost->alpha_us + flows * s.bytes / (g_.cross_gbps * payload * 1e9 / 8) * 1e6;
      us = std::max(us, wire_us);
    }
    how += fmt::format("{}{} on {} x{}{}", how.empty() ? "" : " + ", algo_key(c, a), link_class_name(cls), n,
                       seen ? " (measured group)" : "");
    return us;
  }

  Prediction predict(Coll c, double bytes) const {
    Prediction p;
    const int n = g_.nranks();
    if (n <= 1) {
      p.how = "one rank: nothing to send";
      return p;
    }
    const bool one_host = g_.hosts == 1;
    const auto shm_it = t_.classes.find(LinkClass::Shm);
    collectives::TunerInput in{c,
                               c == Coll::Allgather ? size_t(bytes / n) : size_t(bytes),
                               n,
                               one_host && g_.local == LinkClass::Shm,
                               false,
                               g_.hosts,
                               g_.hosts > 1 && g_.ranks_per_host > 1 ? g_.ranks_per_host : 0};
    in.single_copy = in.all_shm && shm_it != t_.classes.end() && shm_it->second.single_copy;
    p.algo = algorithm_run(in, th_);
    const bool pow2 = [&] {
      const int h = g_.hosts, l = g_.ranks_per_host;
      return (h & (h - 1)) == 0 && (l & (l - 1)) == 0;
    }();
    if (!one_host && g_.ranks_per_host > 1 && pow2 && (p.algo == Algo::RecursiveDoubling || p.algo == Algo::Binomial)) {
      // Recursive doubling and the binomial tree pair ranks 1, 2, 4, ... apart: with the ranks of a
      // host numbered together, the first log2 L steps stay on the host and the last log2 H cross,
      // each the same step as in a group of L (or H) ranks.
      p.us = flat(g_.local, c, p.algo, bytes, g_.ranks_per_host, 1, true, p.how) +
             flat(g_.cross, c, p.algo, bytes, g_.hosts, g_.ranks_per_host, false, p.how);
      return p;
    }
    if (p.algo != Algo::Hierarchical) {
      // Flat: on several hosts every step of the other flat algorithms has a pair across hosts.
      const LinkClass cls = one_host ? g_.local : g_.cross;
      const int flows = p.algo == Algo::Ring || p.algo == Algo::Pipeline ? 1 : g_.ranks_per_host;
      p.us = flat(cls, c, p.algo, bytes, n, flows, one_host || g_.ranks_per_host == 1, p.how);
      return p;
    }
    p.us = hierarchical(c, bytes, p.how);
    p.how = "hierarchical: " + p.how;
    return p;
  }

 private:
  double hierarchical(Coll c, double bytes, std::string& how) const {
    const int H = g_.hosts, L = g_.ranks_per_host;
    auto bcast_algo = [&](int m) { return m <= 2 || bytes <= double(th_.broadcast_binomial_max) ? Algo::Binomial : Algo::Pipeline; };
    switch (c) {
      case Coll::Allreduce: {
        const double part = bytes / L;
        const Algo cross = part <= double(th_.allreduce_rd_max_tcp) ? Algo::RecursiveDoubling : Algo::Ring;
        return flat(g_.local, Coll::ReduceScatter, Algo::Ring, bytes, L, 1, true, how) +
               flat(g_.cross, Coll::Allreduce, cross, part, H, L, false, how) +
               flat(g_.local, Coll::Allgather, Algo::Ring, bytes, L, 1, true, how);
      }
      // On the host these run one ring per host's blocks (hierarchical_others.cpp): H rings of bytes / H.
      case Coll::Allgather:
        return flat(g_.cross, Coll::Allgather, Algo::Ring, bytes / L, H, L, false, how) +
               H * flat(g_.local, Coll::Allgather, Algo::Ring, bytes / H, L, 1, true, how);
      case Coll::ReduceScatter:
        return H * flat(g_.local, Coll::ReduceScatter, Algo::Ring, bytes / H, L, 1, true, how) +
               flat(g_.cross, Coll::ReduceScatter, Algo::Ring, bytes / L, H, L, false, how);
      case Coll::Broadcast:
        // (The cross phase's ranks share their hosts with the others': not a group of one rank per host.)
        return flat(g_.cross, Coll::Broadcast, bcast_algo(H), bytes, H, 1, false, how) +
               flat(g_.local, Coll::Broadcast, bcast_algo(L), bytes, L, 1, true, how);
      default: break;
    }
    throw InvalidArgument(fmt::format("{} has no node-aware algorithm", collectives::coll_name(c)));
  }

  const CostTable& t_;
  const GroupShape& g_;
  const collectives::Thresholds& th_;
};

}  // namespace

Algo algorithm_run(const collectives::TunerInput& in, const collectives::Thresholds& th) {
  const std::optional<Algo> forced = collectives::forced_algo(in.coll);
  Algo a = forced.value_or(collectives::choose(in, th));
  // Where the group could not run what COHORT_ALGO names, it runs the tuner's choice.
  if ((a == Algo::Hierarchical && (in.hosts < 2 || in.ranks_per_host < 2)) || (a == Algo::SingleCopy && !in.single_copy))
    a = collectives::choose(in, th);
  // What the group runs on ordinary buffers (cohort bench's, the calibration's) when single copy was not forced.
  const size_t total = in.coll == Coll::Allgather ? in.bytes * static_cast<size_t>(in.nranks) : in.bytes;
  if (a == Algo::SingleCopy && forced != Algo::SingleCopy && collectives::single_copy_shared_only(in.coll, total, th))
    return Algo::Ring;
  return a;
}

Prediction predict_collective(const CostTable& table, Coll c, double bytes, const GroupShape& g,
                              const collectives::Thresholds& th) {
  if (g.hosts < 1 || g.ranks_per_host < 1)
    throw InvalidArgument(fmt::format("a group of {} host(s) x {} rank(s): both must be >= 1", g.hosts, g.ranks_per_host));
  return Predictor(table, g, th).predict(c, bytes);
}

}  // namespace cohort::plan
