// Predicted time of one collective on a group laid out over hosts: the
// algorithm the tuner would pick (collectives/tuner.hpp, the same function
// the groups call), its shape, and the cost of its link class; the
// node-aware algorithms as the sum of their phases, each on its own class.
#pragma once

#include <string>

#include "collectives/tuner.hpp"
#include "plan/cost_model.hpp"

namespace cohort::plan {

struct GroupShape {
  int hosts = 1;
  int ranks_per_host = 1;
  // The hosts are network namespaces (or containers) of one machine: all
  // ranks share its cores. Otherwise each host has cores_per_host.
  bool same_machine = false;
  int cores_per_host = 0;  // 0: the cores of the machine each class was measured on
  LinkClass local = LinkClass::Shm;       // between the ranks of one host
  LinkClass cross = LinkClass::TcpCross;  // between hosts
  double cross_gbps = 0;  // each host's link, Gbit/s each way; 0: as fast as calibrated
  int nranks() const { return hosts * ranks_per_host; }
};

struct Prediction {
  double us = 0;
  Algo algo = Algo::Ring;
  std::string how;  // "ring on tcp_cross", "hierarchical: ...", for people
};

// What the group runs: COHORT_ALGO's algorithm where it can, else choose()'s,
// with the fallback the group makes when the buffers are
// not shared buffers (ProcessGroup::allocate_buffer): single copy below
// allreduce_single_copy_min (and for allgather, reduce_scatter) runs the ring
// then. The model, like `cohort bench`, assumes ordinary buffers.
Algo algorithm_run(const collectives::TunerInput& in, const collectives::Thresholds& th);

// `bytes` is nccl-tests' size (cost_model.hpp, algo_shape). Throws
// InvalidArgument when the table lacks a link class or an algorithm the
// prediction needs, saying which and how to measure it.
Prediction predict_collective(const CostTable& table, Coll c, double bytes, const GroupShape& g,
                              const collectives::Thresholds& th = collectives::Thresholds{});

}  // namespace cohort::plan
