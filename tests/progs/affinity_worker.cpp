// Test helper for `cohort run --bind`: prints the CPUs this worker may run on,
// as sched_getaffinity reports them, on one line: "AFFINITY=0-1".
#include <cstdio>

#include "core/cpu_list.hpp"

int main() {
  std::printf("AFFINITY=%s\n", cohort::core::cpu_list_text(cohort::core::current_affinity()).c_str());
  return 0;
}
