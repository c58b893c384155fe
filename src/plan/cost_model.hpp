// The alpha-beta cost model of cohort's collectives (docs/planning.md).
//
// Every algorithm the tuner can pick has a shape: the serial steps a rank
// takes and the bytes that pass through it, as closed forms of the message
// size S and the group size n (ring allreduce: 2(n-1) steps, 2(n-1)/n S
// bytes). Per link class (shared memory, TCP on one host, TCP across hosts,
// NCCL) and per algorithm, three coefficients turn a shape into time:
//
//   t = steps * (alpha + alpha_os * excess) + bytes * beta * share
//
// where, for the ranks that share one machine's cores, excess = max(0,
// ranks - cores) and share = max(1, ranks / cores): a rank that must wait for
// a core pays per step (the scheduler's time slice), and the copies of all
// ranks share the cores. `cohort bench --calibrate` measures the collectives
// on a real group and fits the coefficients by least squares on the relative
// error (calibration.cpp); a datasheet class (a GPU cluster on paper) gives
// one alpha and beta for every algorithm instead.
#pragma once

#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "collectives/tuner.hpp"

namespace cohort::plan {

using collectives::Algo;
using collectives::Coll;

enum class LinkClass { Shm, TcpLocal, TcpCross, NcclLocal, NcclCross };
const char* link_class_name(LinkClass c);
std::optional<LinkClass> parse_link_class(const std::string& s);
std::vector<LinkClass> all_link_classes();

// What one rank does in one algorithm: serial steps and bytes through it.
struct Shape {
  double steps = 0;
  double bytes = 0;
};

// S is the collective's size as nccl-tests prints it: the buffer of
// allreduce, broadcast and reduce; the whole output of allgather; the whole
// input of reduce_scatter. `segment` is the broadcast chain's segment.
Shape algo_shape(Coll c, Algo a, double S, int n, double segment = 256 * 1024);

// The key of one algorithm of one collective in a cost table: "allreduce/ring".
std::string algo_key(Coll c, Algo a);

struct AlgoCost {
  double alpha_us = 0;          // per step
  double alpha_os_us = 0;       // per step and per rank beyond the machine's cores
  double beta_us_per_byte = 0;  // per byte of the shape, times max(1, ranks / cores)
  int points = 0;               // samples behind the fit (0: a datasheet value)
  double max_rel_err = 0;       // the fit's worst relative error on them
};

// Where the ranks of a collective run on one link class.
struct Contention {
  int machine_ranks = 1;  // ranks sharing one machine's cores
  int cores = 1;          // that machine's cores (or GPUs: each rank its own)
};

double cost_us(const AlgoCost& a, const Shape& s, const Contention& c);

// The coefficients differ by regime: a message that fits in the caches
// copies faster than one that streams from memory, as NCCL's protocols have
// their own latency and bandwidth. So each algorithm is fitted per size
// band (by nccl-tests' size): up to 16 KiB, 256 KiB, 4 MiB, and above.
constexpr int kBands = 4;
constexpr double kBandEdges[kBands - 1] = {16 * 1024, 256 * 1024, 4 * 1024 * 1024};
int size_band(double bytes);
const char* band_name(int band);  // "small", "medium", "large", "huge"
std::string band_key(const std::string& key, int band);  // "allreduce/ring@large"

// The key of one algorithm measured on one group: "allreduce/ring@n4m4"
// (n ranks, m of them sharing the machine's cores).
std::string group_key(const std::string& key, int n, int machine_ranks);

// One link class's costs: per algorithm key and band, or "*" for every algorithm.
struct ClassCosts {
  std::map<std::string, AlgoCost> fits;
  // The samples themselves, per group_key, sorted by bytes (calibrated
  // classes only). One set of coefficients over every group size cannot
  // hold both a core per rank and ranks that wait for a core (on a 2-core
  // machine 2 ranks copy at cache speed and 8 ranks queue): a group the
  // class was measured at is read from its own samples instead.
  std::map<std::string, std::vector<std::pair<double, double>>> by_group;  // bytes -> us
  // At a measured group with 2 or more sizes of this algorithm, for `bytes`
  // between the smallest and the largest of them: the time on the
  // alpha-beta line through the two measured sizes around it. Else nullopt.
  std::optional<double> at_measured_group(const std::string& key, double bytes, int n, int machine_ranks) const;
  int cores = 0;             // of the machine it was measured on (0: datasheet)
  bool single_copy = false;  // the group could use single copy (shm)
  std::string measured;      // how and when, for people
  // The fit of key in the band of `bytes`, else of the nearest band, else "*".
  const AlgoCost* find(const std::string& key, double bytes) const;
};

struct CostTable {
  std::string source;  // the calibration file, or "datasheet"
  std::map<LinkClass, ClassCosts> classes;
};

}  // namespace cohort::plan
