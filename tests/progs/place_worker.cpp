// Test helper for launch_env_test: started by mpirun, or with Slurm-like
// variables as srun would set them, it finds its place from the environment
// alone, runs one allreduce over the world group and checks the result.
//
// Prints one line on success:
//   place rank=R size=N local_rank=L local_size=M source=<launcher> addr=<store host>: allreduce ok
// Exit codes: 0 ok, 3 cohort error ("ERROR: ..." on stderr), 4 wrong sum.
#include <cstdio>
#include <string>
#include <vector>

#include "cohort/cohort.hpp"
#include "group/launch_env.hpp"

int main() {
  try {
    const auto le = cohort::group::read_launch_env(cohort::group::process_env());
    auto pg = cohort::init_process_group();
    const int n = pg->size(), me = pg->rank();
    // 1001 elements: odd, not divisible by the world size.
    std::vector<float> v(1001);
    for (size_t i = 0; i < v.size(); ++i) v[i] = float(me + 1) * float(i % 7);
    pg->allreduce(cohort::buffer(v))->wait();
    const float ranks_sum = float(n * (n + 1) / 2);
    for (size_t i = 0; i < v.size(); ++i)
      if (v[i] != ranks_sum * float(i % 7)) {
        std::fprintf(stderr, "WRONG: rank %d element %zu: %f != %f\n", me, i, v[i], ranks_sum * float(i % 7));
        return 4;
      }
    pg->shutdown();
    std::printf("place rank=%d size=%d local_rank=%d local_size=%d source=%s addr=%s: allreduce ok\n", me, n,
                le.local_rank.value_or(-1), le.local_world_size.value_or(-1), le.source.c_str(),
                le.master_addr.c_str());
    return 0;
  } catch (const cohort::Error& e) {
    std::fprintf(stderr, "ERROR: %s\n", e.what());
    return 3;
  }
}
