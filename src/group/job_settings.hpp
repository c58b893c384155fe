// Settings that every rank of a job must share.
//
// The tuner's thresholds, COHORT_ALGO and the transport choose each
// collective's algorithm, and every rank must run the same one: a rank whose
// environment says otherwise would wait for messages no peer sends, until the
// timeout. NativeGroup::connect publishes each rank's settings beside its host
// identity and refuses to start when they differ, naming the knob and ranks.
// Pure functions (tests pass the strings).
#pragma once

#include <string>
#include <vector>

namespace cohort::group {

// "NAME=value" lines, one per knob that must agree, with the value normalised
// (sizes in bytes, booleans 1/0), and "transport=<transport>". Throws
// InvalidArgument (from the knob) for a value that does not parse.
std::string job_wide_settings(const std::string& transport);

// "" when every rank's settings (by rank) are the same; else what differs, as
// the message of the error every rank raises: the first differing knob, the
// first rank that differs from rank 0, both values, and the fix.
std::string settings_disagreement(const std::vector<std::string>& settings_by_rank);

}  // namespace cohort::group
