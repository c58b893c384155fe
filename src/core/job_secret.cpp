#include "core/job_secret.hpp"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "cohort/error.hpp"
#include "core/env.hpp"
#include "core/sha256.hpp"

namespace cohort::core {
namespace {

const Knob kSecret{
    "COHORT_SECRET", "",
    "the job secret: store clients and TCP peers must prove they know it (HMAC-SHA256 challenge-response; "
    "it never crosses the wire); `cohort run` makes a random one per single-node job; give every node of "
    "a multi-node job the same one"};
const Knob kSecretFile{"COHORT_SECRET_FILE", "",
                       "a file holding the job secret (used when COHORT_SECRET is unset; keep it mode 0600)"};
const Knob kStoreSecret{"COHORT_STORE_SECRET", "",
                        "older name of COHORT_SECRET (used when neither it nor "
                        "COHORT_SECRET_FILE is set)"};

}  // namespace

std::string job_secret() {
  if (kSecret.is_set() && !kSecret.str().empty()) return kSecret.str();
  if (kSecretFile.is_set() && !kSecretFile.str().empty()) {
    const std::string path = kSecretFile.str();
    std::ifstream in(path, std::ios::binary);
    if (!in)
      throw InvalidArgument(
          fmt::format("COHORT_SECRET_FILE={} cannot be read ({}); point it at a readable file that "
                      "holds the job secret, or set COHORT_SECRET instead",
                      path, std::strerror(errno)));
    std::ostringstream ss;
    ss << in.rdbuf();
    std::string s = ss.str();
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
    if (s.empty())
      throw InvalidArgument(
          fmt::format("COHORT_SECRET_FILE={} is empty; write the job secret into it (for example "
                      "`head -c 32 /dev/urandom | xxd -p -c 64 > {}`)",
                      path, path));
    return s;
  }
  return kStoreSecret.str();
}

std::string random_secret() {
  uint8_t b[32];
  random_bytes(b, sizeof(b));
  return to_hex(b, sizeof(b));
}

}  // namespace cohort::core
