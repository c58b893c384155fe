// The NCCL backend of a build without CUDA: says how to get one.
#include <fmt/format.h>

#include "group/nccl/nccl_group.hpp"

namespace cohort::group {

bool nccl_backend_built() {
  return false;
}

std::shared_ptr<ProcessGroup> create_nccl_group(const GroupSetup&, std::optional<int>) {
  throw InvalidArgument(
      "backend 'nccl': this build has no NCCL backend: rebuild with -DCOHORT_CUDA=ON on a machine with CUDA and NCCL "
      "(docs/nccl.md), or use COHORT_BACKEND=native with host buffers");
}

}  // namespace cohort::group
