// `cohort run`'s part of the job secret (core/job_secret.hpp).
#pragma once

#include <string>

namespace cohort::launch {

// Makes sure the launcher and its workers share a job secret. One node: when
// the user set none, a random 256-bit one is put in COHORT_SECRET of this
// process (so the store the launcher hosts requires it, and the workers
// inherit it). Several nodes: the user must give the same secret to every
// node; returns a warning to print when none is set (else ""). Throws
// InvalidArgument when COHORT_SECRET_FILE cannot be read.
std::string ensure_job_secret(int nnodes);

}  // namespace cohort::launch
