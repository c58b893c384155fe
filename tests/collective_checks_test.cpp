// The collective suite's value pattern (collective_checks.hpp) must catch data
// at the wrong offset. These tests move a correct allreduce result the way a
// broken algorithm would (one rank's chunk shifted by s elements) and count
// the elements the suite's check would flag. The pattern the suite used
// before, k = i % 3 + 1, let every shift by a multiple of 3 pass (a chunk
// shifted at 3 or 6 ranks, say); the last test shows that, for the record.
#include <gtest/gtest.h>

#include "collective_checks.hpp"

namespace cohort::checks {
namespace {

// How many elements of [from, from + len) a result shifted by `shift` gets wrong.
size_t wrong_after_shift(size_t from, size_t len, size_t shift, ReduceOp op, int n, DType t) {
  size_t wrong = 0;
  for (size_t j = from; j < from + len; ++j)
    if (expected(j + shift, op, n, t) != expected(j, op, n, t)) ++wrong;
  return wrong;
}

TEST(CollectiveChecks, AChunkShiftedByAnyOffsetIsCaught) {
  const size_t count = counts_for(8).back();  // the suite's large count
  for (int n : {2, 3, 4, 5, 6, 8})
    for (DType t : kAllTypes)
      for (ReduceOp op : kAllOps) {
        const size_t chunk = count / n;
        for (size_t shift : {size_t(1), size_t(2), size_t(3), size_t(6), size_t(9), size_t(n), size_t(3 * n)})
          for (int c = 0; c < n; ++c) {
            const size_t wrong = wrong_after_shift(c * chunk, chunk, shift, op, n, t);
            // A hash into 3 values differs at about 2/3 of the elements; prod at 2
            // ranks (products 1, 2, 4) at about 5/8. A quarter is a safe floor.
            EXPECT_GT(wrong, chunk / 4) << "n " << n << " " << dtype_name(t) << " " << reduce_op_name(op)
                                        << ": chunk " << c << " shifted by " << shift << " elements";
          }
      }
}

TEST(CollectiveChecks, ValuesAreExactInEveryDtype) {
  // Every input and expected value survives a round trip through every dtype
  // (so a check never fails or passes because of rounding).
  for (int n : {1, 2, 3, 4, 5, 8})
    for (DType t : kAllTypes)
      for (ReduceOp op : kAllOps) {
        Vec v(64, t);
        for (size_t i = 0; i < 64; ++i) {
          for (int r = 0; r < n; ++r) {
            v.set(i, input(r, i, op, n));
            ASSERT_EQ(v.get(i), input(r, i, op, n)) << dtype_name(t) << " input rank " << r << " element " << i;
          }
          v.set(i, expected(i, op, n, t));
          ASSERT_EQ(v.get(i), expected(i, op, n, t))
              << dtype_name(t) << " " << reduce_op_name(op) << " n " << n << " element " << i;
        }
      }
}

TEST(CollectiveChecks, TheOldPeriodThreePatternMissedShiftsByThree) {
  auto old_k = [](size_t i) { return double(i % 3 + 1); };
  size_t wrong = 0;
  for (size_t j = 0; j < 10000; ++j) wrong += old_k(j + 3) != old_k(j);
  EXPECT_EQ(wrong, 0u) << "the old pattern repeats every 3 elements: a shift by 3 was invisible to it";
}

}  // namespace
}  // namespace cohort::checks
