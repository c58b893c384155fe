// The collectives `cohort bench` knows: how to size their buffers, run them,
// fill and check them, and their busbw factor (nccl-tests' PERFORMANCE.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cohort/cohort.hpp"

namespace cohort::tools {

struct BenchColl {
  const char* name;
  bool reduces;  // takes -o
  bool rooted;   // takes -r
  // nccl-tests' size -> elements in this rank's send and recv buffers.
  void (*counts)(size_t size_count, int n, size_t& send_count, size_t& recv_count);
  // busbw = algbw * factor
  double (*factor)(int n);
};

const BenchColl* find_bench_coll(const std::string& name);
std::vector<std::string> bench_coll_names();

struct BenchCase {
  const BenchColl* coll;
  DType dtype;
  ReduceOp op;
  int root;
  bool in_place;
};

// Starts one operation on (send, recv) and returns its Work.
WorkPtr run_once(ProcessGroup& pg, const BenchCase& c, Buffer send, Buffer recv);
// Fills send with this rank's check pattern (and poisons recv).
void fill_inputs(ProcessGroup& pg, const BenchCase& c, Buffer send, Buffer recv);
// Counts wrong elements of this rank's result.
int64_t count_wrong(ProcessGroup& pg, const BenchCase& c, Buffer send, Buffer recv);

}  // namespace cohort::tools
