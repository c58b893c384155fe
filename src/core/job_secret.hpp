// The job secret: what every connection to the store and between ranks
// (TCP) must prove it knows, in a challenge-response (the secret itself never
// crosses the wire). docs/fault-tolerance.md "Security".
//
// Where it comes from, first found wins:
//   COHORT_SECRET            the secret itself
//   COHORT_SECRET_FILE       a file holding it (one line; mode 0600 advised)
//   COHORT_STORE_SECRET      the older name, still honoured
// `cohort run` on one node makes a random one per job when none is set and
// passes it to its workers in COHORT_SECRET. A multi-node job needs the user to
// give the same one to every node (it warns when there is none).
#pragma once

#include <string>

namespace cohort::core {

// The configured secret ("" when none). Throws InvalidArgument naming
// COHORT_SECRET_FILE when that file cannot be read or is empty.
std::string job_secret();

// 64 hex digits (256 bits) from the kernel's random source.
std::string random_secret();

}  // namespace cohort::core
