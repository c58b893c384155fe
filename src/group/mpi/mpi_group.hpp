// The MPI backend's entry point: the one declaration init_process_group needs.
//
// This header has no MPI include, so that init.cpp compiles the same in every
// build. A build that found MPI (CMake's COHORT_WITH_MPI, docs/mpi.md) defines
// create_mpi_group in mpi_group.cpp; any other build links mpi_unavailable.cpp,
// whose create_mpi_group throws InvalidArgument saying how to get the backend.
#pragma once

#include <memory>
#include <optional>

#include "cohort/process_group.hpp"

namespace cohort::group {

// True when this build has the MPI backend.
bool mpi_backend_built();

// Builds the world group of the MPI backend: initialises MPI (unless the
// program already did) and duplicates MPI_COMM_WORLD. Rank and size are MPI's;
// a rank or world size given in InitOptions must agree with them
// (InvalidArgument otherwise). `timeout` is the group's deadline for every
// operation. Collective over all processes of MPI_COMM_WORLD.
std::shared_ptr<ProcessGroup> create_mpi_group(std::optional<int> rank, std::optional<int> world_size, Millis timeout);

}  // namespace cohort::group
