// An allreduce through the installed package: each rank contributes rank + 1
// in every element; every rank checks the sum, n(n+1)/2, and prints it.
#include <cstdio>
#include <vector>

#include "cohort/cohort.hpp"

int main() {
  try {
    auto pg = cohort::init_process_group();
    const int n = pg->size();
    std::vector<float> v(1000, static_cast<float>(pg->rank() + 1));
    pg->allreduce(cohort::buffer(v), cohort::buffer(v), {.op = cohort::ReduceOp::Sum})->wait();
    const float want = static_cast<float>(n * (n + 1) / 2);
    for (float x : v)
      if (x != want) {
        std::fprintf(stderr, "rank %d: got %g, want %g\n", pg->rank(), x, want);
        return 1;
      }
    std::printf("rank %d of %d: allreduce sum %g (cohort %s)\n", pg->rank(), n, want, cohort::version());
    pg->shutdown();
    return 0;
  } catch (const cohort::Error& e) {  // a cohort exception type, caught outside libcohort
    std::fprintf(stderr, "cohort error: %s\n", e.what());
    return 2;
  }
}
