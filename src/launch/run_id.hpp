// COHORT_RUN_ID: the per-job id workers use to name their shared-memory
// segments (/dev/shm/cohort-<id>-*), and the launcher's cleanup of them.
#pragma once

#include <string>

namespace cohort::launch {

// "<run_id>-<8 random hex digits>", the user's --rdzv-id cut to 24 safe
// characters ([A-Za-z0-9_.-]; "none" becomes "job"). Unique per call, so two
// jobs with the same --rdzv-id on one machine never share segments.
std::string make_cohort_run_id(const std::string& run_id);

// A random id like torchrun's uuid-based --standalone run id (32 hex digits).
std::string random_hex(int digits);

// Removes /dev/shm/cohort-<cohort_run_id>-* (segments crashed workers left
// behind). Call only when no worker of the job runs on this node. Returns how
// many were removed; never throws.
int remove_shm_segments(const std::string& cohort_run_id, const std::string& shm_dir = "/dev/shm");

}  // namespace cohort::launch
