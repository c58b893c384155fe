#include "launch/job_secret_setup.hpp"

#include <cstdlib>

#include "core/job_secret.hpp"

namespace cohort::launch {

std::string ensure_job_secret(int nnodes) {
  if (!core::job_secret().empty()) return "";
  if (nnodes > 1)
    return "no job secret is set (COHORT_SECRET or COHORT_SECRET_FILE): any process that can reach the store's port "
           "can "
           "read and write the job's keys; give every node the same secret, e.g. "
           "COHORT_SECRET_FILE=/path/shared/secret";
  const std::string secret = core::random_secret();
  setenv("COHORT_SECRET", secret.c_str(), 1);
  return "";
}

}  // namespace cohort::launch
