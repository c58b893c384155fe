// The MPI backend of a build without MPI: says how to get one.
#include "group/mpi/mpi_group.hpp"

namespace cohort::group {

bool mpi_backend_built() {
  return false;
}

std::shared_ptr<ProcessGroup> create_mpi_group(std::optional<int>, std::optional<int>, Millis) {
  throw InvalidArgument(
      "backend 'mpi': this build has no MPI backend: install an MPI (apt-get install libopenmpi-dev openmpi-bin) and "
      "rebuild (CMake finds it; -DCOHORT_WITH_MPI=ON makes it required, docs/mpi.md), or use COHORT_BACKEND=native");
}

}  // namespace cohort::group
