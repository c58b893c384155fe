// The calibration file `cohort bench --calibrate FILE` writes and `cohort
// plan --calibration FILE` reads (docs/planning.md, "Calibration"): per link
// class, the measured times of the collectives at each size and group size,
// and the cost model's coefficients fitted to them.
//
// The file is JSON: {"format": "cohort-calibration", "format_version": 1,
// "cohort_version": "0.1.0", "classes": {"shm": {"cores": 2, "single_copy":
// true, "measured": "...", "samples": [[coll, algo, n, machine_ranks, bytes,
// us], ...], "fits": {"allreduce/ring": {...}}}}}. The fits are for reading;
// they are fitted again from the samples when the file is read.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "plan/cost_model.hpp"

namespace cohort::plan {

struct Sample {
  Coll coll = Coll::Allreduce;
  Algo algo = Algo::Ring;
  int n = 2;              // group size
  int machine_ranks = 2;  // ranks that shared the machine's cores
  double bytes = 0;       // nccl-tests' size (algo_shape)
  double us = 0;          // measured, per call
};

struct ClassSamples {
  int cores = 1;
  bool single_copy = false;
  double segment = 256 * 1024;  // the broadcast chain's segment when measured
  std::string measured;
  std::vector<Sample> samples;
};

struct Calibration {
  std::string cohort_version;
  std::map<LinkClass, ClassSamples> classes;
};

// Least squares of the model on the samples' relative error, with every
// coefficient >= 0 (the best of the fits on each subset of the three terms).
AlgoCost fit_algo(const std::vector<Sample>& samples, int cores, double segment);
ClassCosts fit_class(const ClassSamples& cs);
CostTable cost_table(const Calibration& cal, const std::string& source);

// Reads a calibration file. Throws InvalidArgument, naming the file and what
// to do, when it is missing, is not a calibration, has another format
// version, or was written by a cohort other than `expect_version` (its
// algorithms and thresholds may differ: calibrate again).
Calibration read_calibration(const std::string& path, const std::string& expect_version);

// The file's text (with the fits) and writing it (temporary file + rename).
std::string calibration_json(const Calibration& cal);
void write_calibration(const std::string& path, const Calibration& cal);

// Replaces the samples of `cls` taken at the same group size and machine
// ranks as `fresh`'s, keeps the others (so calibrations at 2, 4 and 8 ranks
// add up), and takes fresh's machine facts.
void merge_samples(Calibration& cal, LinkClass cls, const ClassSamples& fresh);

}  // namespace cohort::plan
