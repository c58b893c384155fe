// A worker for the hang-verdict tests, started by `cohort run`.
//
//   hang_worker hang VICTIM SLEEP_S ITERS ELEMENTS
//       every rank runs ITERS allreduces of ELEMENTS floats (#0 .. #ITERS-1);
//       VICTIM sleeps SLEEP_S seconds before the last one, so the others time
//       out in it (set COHORT_TIMEOUT below SLEEP_S).
//   hang_worker desync ELEMENTS
//       one allreduce; rank 1 passes twice as many elements as the others.
//   hang_worker stop VICTIM ITERS ELEMENTS
//       allreduces back to back, as a training loop runs them; before the
//       last one VICTIM stops itself with SIGSTOP (as a debugger or a frozen
//       host would), busy until then, never idle.
// A rank that fails prints "ERROR: ..." and exits 3.
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "cohort/cohort.hpp"

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (!((mode == "hang" && argc == 6) || (mode == "desync" && argc == 3) || (mode == "stop" && argc == 5))) {
    std::fprintf(stderr,
                 "usage: hang_worker hang VICTIM SLEEP_S ITERS ELEMENTS | desync ELEMENTS | stop VICTIM ITERS "
                 "ELEMENTS\n");
    return 2;
  }
  try {
    auto pg = cohort::init_process_group();
    if (mode == "desync") {
      const size_t elements = std::stoul(argv[2]);
      std::vector<float> v(pg->rank() == 1 ? 2 * elements : elements, 1.0f);
      pg->allreduce(cohort::buffer(v))->wait();
      std::printf("rank %d finished\n", pg->rank());
      return 0;
    }
    if (mode == "stop") {
      const int victim = std::atoi(argv[2]);
      const int iters = std::atoi(argv[3]);
      std::vector<float> v(std::stoul(argv[4]), 1.0f);
      for (int it = 0; it < iters; ++it) {
        if (it == iters - 1 && pg->rank() == victim) ::raise(SIGSTOP);
        pg->allreduce(cohort::buffer(v))->wait();
      }
      std::printf("rank %d finished\n", pg->rank());
      return 0;
    }
    const int victim = std::atoi(argv[2]);
    const int sleep_s = std::atoi(argv[3]);
    const int iters = std::atoi(argv[4]);
    const size_t elements = std::stoul(argv[5]);
    std::vector<float> v(elements, 1.0f);
    for (int it = 0; it < iters; ++it) {
      if (it == iters - 1 && pg->rank() == victim) std::this_thread::sleep_for(std::chrono::seconds(sleep_s));
      pg->allreduce(cohort::buffer(v))->wait();
    }
    std::printf("rank %d finished\n", pg->rank());
    return 0;
  } catch (const cohort::Error& e) {
    std::fprintf(stderr, "ERROR: %s\n", e.what());
    return 3;
  }
}
