// What cohort's mpi backend adds to MPI's own call, measured in one process:
// the same buffers, the same communicator size, MPI_Allreduce called directly
// and through ProcessGroup::allreduce (COHORT_BACKEND=mpi), in alternating
// blocks so that the host's drift hits both alike. Prints the median and the
// minimum of 15 blocks per size. Under `mpirun -np 1` the MPI call is a local
// copy, so the difference is the backend's call path alone (validation, lock,
// watchdog, Work); with -np 2 it is the figure next to MPI's latency.
//
//   mpicxx -O2 -std=c++20 -Iinclude bench/mpi_call_overhead.cpp -Lbuild -lcohort -Wl,-rpath,$PWD/build \
//       -o build/mpi_call_overhead
//   mpirun -np 2 build/mpi_call_overhead [ITERS_PER_BLOCK [BYTES,BYTES,...]]   (default 20000 8,1024)
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cohort/cohort.hpp"

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20000;
  cohort::InitOptions o;
  o.backend = "mpi";
  auto pg = cohort::init_process_group(o);  // initialises MPI
  std::vector<size_t> sizes = {8, 1024};
  if (argc > 2) {
    sizes.clear();
    for (char* p = argv[2]; *p != '\0';) {
      sizes.push_back(std::strtoull(p, &p, 10));
      if (*p == ',') ++p;
    }
  }
  for (size_t bytes : sizes) {
    const size_t n = bytes / sizeof(float);
    std::vector<float> a(n, 1.0f), b(n);
    std::vector<double> direct, through;
    for (int block = 0; block < 15; ++block) {
      MPI_Barrier(MPI_COMM_WORLD);
      double t0 = MPI_Wtime();
      const int it = static_cast<int>(std::max<size_t>(5, std::min<size_t>(iters, (size_t(1) << 31) / (bytes * 16))));
      for (int i = 0; i < it; ++i)
        MPI_Allreduce(a.data(), b.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      double t1 = MPI_Wtime();
      MPI_Barrier(MPI_COMM_WORLD);
      double t2 = MPI_Wtime();
      for (int i = 0; i < it; ++i) pg->allreduce(cohort::buffer(a), cohort::buffer(b))->wait();
      double t3 = MPI_Wtime();
      direct.push_back((t1 - t0) / it * 1e6);
      through.push_back((t3 - t2) / it * 1e6);
    }
    std::sort(direct.begin(), direct.end());
    std::sort(through.begin(), through.end());
    if (pg->rank() == 0)
      std::printf(
          "%9zu B, %d rank(s): MPI_Allreduce %.3f us (min %.3f), cohort mpi backend %.3f us (min %.3f): +%.3f us\n",
          bytes, pg->size(), direct[7], direct[0], through[7], through[0], through[7] - direct[7]);
  }
  pg->shutdown();
  return 0;
}
