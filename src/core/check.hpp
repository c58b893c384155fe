// Assertions for broken invariants (bugs in cohort, not user errors: those throw,
// see docs/errors.md). They stay on in release builds: a silent wrong result in a
// collective is worse than a crash with a location.
#pragma once

#include <cstdio>
#include <cstdlib>

#define COHORT_ASSERT(cond, msg)                                                             \
  do {                                                                                       \
    if (__builtin_expect(!(cond), 0)) {                                                      \
      std::fprintf(stderr, "cohort: internal error at %s:%d: %s (%s)\n"                      \
                           "HINT: this is a bug in cohort; please report it with this line\n", \
                   __FILE__, __LINE__, msg, #cond);                                          \
      std::abort();                                                                          \
    }                                                                                        \
  } while (0)
