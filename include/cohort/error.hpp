// cohort/error.hpp: the exceptions cohort throws (see docs/errors.md).
//
// Errors a user can cause or recover from are typed exceptions whose message
// says the cause and the fix. Broken internal invariants are not exceptions:
// they abort with file:line (COHORT_ASSERT in src/core/check.hpp).
#pragma once

#include <stdexcept>
#include <string>
#include "cohort/export.hpp"

namespace cohort {

class COHORT_API Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad arguments: wrong count, dtype, root, rank not in group, bad flag value.
class COHORT_API InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A deadline passed (COHORT_TIMEOUT or a per-call timeout).
class COHORT_API TimeoutError : public Error {
 public:
  using Error::Error;
};

// A peer died, closed its connection, aborted, or sent something we did not expect.
// peer() is the rank in the group that failed (-1 if unknown).
class COHORT_API PeerError : public Error {
 public:
  PeerError(const std::string& what, int peer) : Error(what), peer_(peer) {}
  int peer() const { return peer_; }

 private:
  int peer_;
};

// Operating-system failures: sockets, files, shared memory.
class COHORT_API IoError : public Error {
 public:
  using Error::Error;
};

// A file exists but its contents are wrong: truncated, corrupted, or not in the
// expected format (checkpoints, safetensors files). The message names the file.
class COHORT_API FormatError : public IoError {
 public:
  using IoError::IoError;
};

}  // namespace cohort
