// `cohort bench --calibrate FILE` (bench_calibrate.cpp): the cost model's
// measurements for `cohort plan`.
#pragma once

#include <cstddef>
#include <string>

namespace cohort::tools {

struct CalibrateFlags {
  std::string file;
  std::string max_bytes = "64M";
  size_t budget_bytes = size_t(512) << 20;  // calls per block and size: this many bytes, 3 to 200 calls
  bool same_machine = false;  // the hosts are namespaces of this machine: all ranks share its cores
  bool verbose = true;
};

int run_calibrate(const CalibrateFlags& f);

}  // namespace cohort::tools
