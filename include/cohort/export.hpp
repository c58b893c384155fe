// COHORT_API marks what libcohort (and libcohort_torch) export. Both are built
// with -fvisibility=hidden, so only the declarations in include/cohort/ that
// carry it are ABI; everything under src/ stays inside the library
// (docs/design.md, "Folder layout"). GCC and Clang on Linux need no import
// side: the same attribute serves the library and its users.
#pragma once

#define COHORT_API [[gnu::visibility("default")]]

// On the out-of-line definition of an exported class's nested implementation
// (`struct COHORT_HIDDEN TcpStore::Impl {`): a nested class takes its outer
// class's visibility otherwise, and its members would become ABI.
#define COHORT_HIDDEN [[gnu::visibility("hidden")]]
