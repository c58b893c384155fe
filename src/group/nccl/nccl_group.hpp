// The NCCL backend's entry point: the one declaration init_process_group needs.
//
// This header has no CUDA or NCCL include, so that init.cpp compiles the same
// in every build. A build with CUDA and NCCL (CMake's COHORT_CUDA, docs/nccl.md)
// defines create_nccl_group in nccl_group.cpp; any other build links
// nccl_unavailable.cpp, whose create_nccl_group throws InvalidArgument saying
// how to get the backend.
#pragma once

#include <memory>
#include <optional>

#include "cohort/process_group.hpp"

namespace cohort::group {

struct GroupSetup;  // group/native_group.hpp

// True when this build has the NCCL backend (it may still find no GPU at run time).
bool nccl_backend_built();

// Builds the world group of the NCCL backend on the GPU of this rank's local
// rank (LOCAL_RANK modulo the visible devices; the rank itself when the local
// rank is unknown). Collective over the ranks of `setup`: rank 0 makes the NCCL
// unique id and publishes it in setup.store. Throws InvalidArgument when the
// build has no NCCL or no CUDA device is visible.
std::shared_ptr<ProcessGroup> create_nccl_group(const GroupSetup& setup, std::optional<int> local_rank);

}  // namespace cohort::group
