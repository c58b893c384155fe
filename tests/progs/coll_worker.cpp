// A worker for multi-process tests, started by `cohort run` or directly with
// RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set.
//
//   coll_worker allreduce-loop BYTES ITERS           check every result; exit 0
//   coll_worker kill-mid VICTIM BYTES ITERS          VICTIM SIGKILLs itself inside
//                                                    iteration 3's allreduce; the others
//                                                    must fail: they print "ERROR: ..." and exit 3
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "cohort/cohort.hpp"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: coll_worker allreduce-loop BYTES ITERS | kill-mid VICTIM BYTES ITERS\n");
    return 2;
  }
  std::string mode = argv[1];
  try {
    auto pg = cohort::init_process_group();
    const int n = pg->size(), me = pg->rank();
    if (mode == "allreduce-loop") {
      size_t count = std::stoul(argv[2]) / 4;
      int iters = std::atoi(argv[3]);
      std::vector<float> v(count);
      for (int it = 0; it < iters; ++it) {
        std::fill(v.begin(), v.end(), float(me + it));
        pg->allreduce(cohort::buffer(v))->wait();
        float want = float(n * (n - 1) / 2 + n * it);
        for (size_t i = 0; i < count; ++i)
          if (v[i] != want) {
            std::fprintf(stderr, "WRONG: rank %d iteration %d element %zu: %f != %f\n", me, it, i, v[i], want);
            return 4;
          }
      }
      std::printf("rank %d ok\n", me);
      return 0;
    }
    if (mode == "kill-mid") {
      int victim = std::atoi(argv[2]);
      size_t count = std::stoul(argv[3]) / 4;
      int iters = std::atoi(argv[4]);
      std::vector<float> v(count, 1.0f);
      for (int it = 0; it < iters; ++it) {
        auto w = pg->allreduce(cohort::buffer(v));
        if (it == 3 && me == victim) {
          std::this_thread::sleep_for(std::chrono::milliseconds(5));  // let the progress thread get going
          std::fprintf(stderr, "VICTIM: rank %d pid %d kills itself\n", me, getpid());
          std::fflush(stderr);
          raise(SIGKILL);
        }
        w->wait();
      }
      std::printf("rank %d finished without noticing\n", me);
      return 0;
    }
  } catch (const cohort::Error& e) {
    std::fprintf(stderr, "ERROR: %s\n", e.what());
    return 3;
  }
  std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
  return 2;
}
