// Tests that need something from outside the project (python3, Debian's
// Fashion-MNIST data, mpirun) skip without it on a developer's machine, and
// fail under CI=true (.ci/run sets it), where scripts/install-deps.sh has
// installed it: a CI run that skips silently tests less than it claims.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

namespace cohort::testing {

inline bool in_ci() {
  const char* ci = std::getenv("CI");
  const std::string v = ci != nullptr ? ci : "";
  return v == "true" || v == "True" || v == "TRUE" || v == "1";
}

}  // namespace cohort::testing

// COHORT_MISSING_DEP("python3 not found" << ...): skip, or fail under CI=true.
#define COHORT_MISSING_DEP(message)                                                                        \
  do {                                                                                                     \
    if (::cohort::testing::in_ci()) {                                                                      \
      FAIL() << "a test dependency is missing under CI=true (scripts/install-deps.sh installs it): "       \
             << message;                                                                                   \
    } else {                                                                                               \
      GTEST_SKIP() << message;                                                                             \
    }                                                                                                      \
  } while (0)
