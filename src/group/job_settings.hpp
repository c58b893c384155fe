// Settings that every rank of a job must share.
//
// The tuner's thresholds, COHORT_ALGO, the TCP striping and the transport
// choose each collective's algorithm and wire format, and every rank must run
// the same one (the ranks of one host, for single copy): a rank whose
// environment says otherwise would wait for messages no peer sends, until the
// timeout. NativeGroup::connect publishes each rank's settings beside its host
// identity and refuses to start when they differ, naming the knob and ranks.
// Pure functions (tests pass the strings).
#pragma once

#include <string>
#include <vector>

namespace cohort::group {

// "job:NAME=value" lines for the knobs every rank must agree on (algorithm
// choice, TCP striping), "host:NAME=value" for those the ranks of one host
// must agree on (single copy, the transport `transport`), with the values
// normalised (sizes in bytes, booleans 1/0). Throws InvalidArgument (from the
// knob) for a value that does not parse.
std::string job_wide_settings(const std::string& transport);

// "" when the settings (by rank) agree: the "job:" ones with rank 0's, the
// "host:" ones with those of the first rank of the same host (host_by_rank:
// host identities). Else the message of the error every rank raises: the
// first differing knob, both ranks, both values, and the fix.
std::string settings_disagreement(const std::vector<std::string>& settings_by_rank,
                                  const std::vector<std::string>& host_by_rank);

}  // namespace cohort::group
