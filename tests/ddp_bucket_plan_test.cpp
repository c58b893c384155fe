// plan_buckets: a pure function, tested directly (docs/design.md habit 8).
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "cohort/ddp.hpp"

namespace cohort::ddp {
namespace {

ParamSpec P(size_t count, DType t = DType::F32) { return ParamSpec{.name = "p", .count = count, .dtype = t}; }

using Idx = std::vector<size_t>;

TEST(BucketPlan, NoParametersNoBuckets) { EXPECT_TRUE(plan_buckets({}).empty()); }

TEST(BucketPlan, ReverseOrderAndSmallFirstBucket) {
  // 7 x 400 bytes; the first bucket holds at most 1000 bytes, the others 2000.
  std::vector<ParamSpec> ps = {P(100), P(100), P(100), P(100), P(100), P(100), P(100)};
  auto plan = plan_buckets(ps, {.cap_bytes = 2000, .first_cap_bytes = 1000});
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].params, (Idx{6, 5}));
  EXPECT_EQ(plan[0].offsets, (Idx{0, 100}));
  EXPECT_EQ(plan[0].count, 200u);
  EXPECT_EQ(plan[1].params, (Idx{4, 3, 2, 1, 0}));  // exactly 2000 bytes: reaches the cap
  EXPECT_EQ(plan[1].offsets, (Idx{0, 100, 200, 300, 400}));
  EXPECT_EQ(plan[1].bytes(), 2000u);
}

// ZeRO's padding: every bucket a multiple of the world size; the caps and the
// parameters' offsets are those of the unpadded plan; a bucket of zero-size
// parameters stays empty.
TEST(BucketPlan, CountMultiplePadsEachBucketAtItsEnd) {
  std::vector<ParamSpec> ps = {P(0), P(7), P(100), P(100), P(101), P(3)};
  auto plain = plan_buckets(ps, {.cap_bytes = 1000, .first_cap_bytes = 500});
  auto padded = plan_buckets(ps, {.cap_bytes = 1000, .first_cap_bytes = 500, .count_multiple = 3});
  ASSERT_EQ(padded.size(), plain.size());
  for (size_t b = 0; b < plain.size(); ++b) {
    EXPECT_EQ(padded[b].params, plain[b].params);
    EXPECT_EQ(padded[b].offsets, plain[b].offsets);
    EXPECT_EQ(padded[b].count % 3, 0u);
    EXPECT_GE(padded[b].count, plain[b].count);
    EXPECT_LT(padded[b].count, plain[b].count + 3);
  }
  EXPECT_EQ(plan_buckets(std::vector<ParamSpec>{P(0)}, {.count_multiple = 4}).at(0).count, 0u);
  EXPECT_EQ(plan_buckets(std::vector<ParamSpec>{P(5)}, {.count_multiple = 0}).at(0).count, 5u);  // 0 is taken as 1
}

TEST(BucketPlan, DefaultCapsAre1And25MiB) {
  std::vector<ParamSpec> ps(30, P(256 * 1024));  // 1 MiB each
  auto plan = plan_buckets(ps);
  ASSERT_EQ(plan.size(), 3u);
  EXPECT_EQ(plan[0].params, (Idx{29}));  // the first bucket: 1 MiB
  EXPECT_EQ(plan[1].params.size(), 25u);
  EXPECT_EQ(plan[1].params.front(), 28u);
  EXPECT_EQ(plan[1].bytes(), size_t(25) << 20);
  EXPECT_EQ(plan[2].params, (Idx{3, 2, 1, 0}));
}

TEST(BucketPlan, EachDtypeHasItsOwnBucket) {
  // Registration: f32, f32, f64, f32, bf16, bf16. Reverse: 5, 4 (bf16), 3 (f32), 2 (f64), 1, 0 (f32).
  std::vector<ParamSpec> ps = {P(10), P(10), P(10, DType::F64), P(10), P(4, DType::BF16), P(4, DType::BF16)};
  auto plan = plan_buckets(ps, {.cap_bytes = 1 << 20, .first_cap_bytes = 1 << 20});
  ASSERT_EQ(plan.size(), 3u);  // in the order they complete: bf16 after 4, f64 after 2, f32 after 0
  EXPECT_EQ(plan[0].params, (Idx{5, 4}));
  EXPECT_EQ(plan[0].dtype, DType::BF16);
  EXPECT_EQ(plan[1].params, (Idx{2}));
  EXPECT_EQ(plan[1].dtype, DType::F64);
  EXPECT_EQ(plan[2].params, (Idx{3, 1, 0}));
  EXPECT_EQ(plan[2].offsets, (Idx{0, 10, 20}));
  EXPECT_EQ(plan[2].dtype, DType::F32);
}

// Mixed precision as models have it: bf16 weights beside f32 norm parameters,
// alternating. A bucket per dtype change would launch one collective per
// parameter; per-dtype buckets launch two, filled to their caps.
TEST(BucketPlan, AlternatingDtypesStillFillBuckets) {
  std::vector<ParamSpec> ps;
  for (int layer = 0; layer < 20; ++layer) {
    ps.push_back(P(1000, DType::BF16));  // 2000 bytes
    ps.push_back(P(100));                // 400 bytes
  }
  auto plan = plan_buckets(ps, {.cap_bytes = 1 << 20, .first_cap_bytes = 1 << 20});
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].dtype, DType::F32);  // its last parameter (index 1) comes before the bf16 one's (index 0)
  EXPECT_EQ(plan[0].params.size(), 20u);
  EXPECT_EQ(plan[1].dtype, DType::BF16);
  EXPECT_EQ(plan[1].bytes(), 40000u);

  // With caps each dtype starts with its own small first bucket.
  plan = plan_buckets(ps, {.cap_bytes = 8000, .first_cap_bytes = 4000});
  size_t bf16 = 0, f32 = 0;
  for (const auto& b : plan) {
    const size_t cap = (b.dtype == DType::BF16 ? bf16++ : f32++) == 0 ? 4000 : 8000;
    EXPECT_LE(b.bytes(), cap);
  }
  EXPECT_EQ(bf16, 1u + (40000 - 4000 + 7999) / 8000);  // 4000, then 8000 at a time
  EXPECT_EQ(f32, 2u);                                  // 4000 bytes, then the other 4000
}

TEST(BucketPlan, ParameterLargerThanTheCapIsAlone) {
  std::vector<ParamSpec> ps = {P(100), P(1000), P(100)};  // 400, 4000, 400 bytes; cap 1000
  auto plan = plan_buckets(ps, {.cap_bytes = 1000, .first_cap_bytes = 1000});
  ASSERT_EQ(plan.size(), 3u);
  EXPECT_EQ(plan[0].params, (Idx{2}));
  EXPECT_EQ(plan[1].params, (Idx{1}));
  EXPECT_EQ(plan[1].bytes(), 4000u);
  EXPECT_EQ(plan[2].params, (Idx{0}));
}

TEST(BucketPlan, CapZeroPutsEveryParameterAlone) {
  std::vector<ParamSpec> ps = {P(1), P(2), P(3)};
  auto plan = plan_buckets(ps, {.cap_bytes = 0, .first_cap_bytes = 0});
  ASSERT_EQ(plan.size(), 3u);
  for (size_t b = 0; b < 3; ++b) EXPECT_EQ(plan[b].params, (Idx{2 - b}));
}

TEST(BucketPlan, ZeroSizeParametersJoinTheirDtypesBucket) {
  // Registration: f32 x0, f32 x10, f64 x0, f32 x10. Reverse: 3, 2 (f64, no
  // space: a bucket of its own that launches nothing), 1, 0.
  std::vector<ParamSpec> ps = {P(0), P(10), P(0, DType::F64), P(10)};
  auto plan = plan_buckets(ps);
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].params, (Idx{2}));
  EXPECT_EQ(plan[0].count, 0u);
  EXPECT_EQ(plan[0].dtype, DType::F64);
  EXPECT_EQ(plan[1].params, (Idx{3, 1, 0}));
  EXPECT_EQ(plan[1].offsets, (Idx{0, 10, 20}));
  EXPECT_EQ(plan[1].count, 20u);
  EXPECT_EQ(plan[1].dtype, DType::F32);

  std::vector<ParamSpec> only_empty = {P(0, DType::F16), P(0)};
  plan = plan_buckets(only_empty);
  ASSERT_EQ(plan.size(), 2u);
  for (const auto& b : plan) EXPECT_EQ(b.count, 0u);
}

TEST(BucketPlan, MixedModel) {
  // The model the reducer tests use (ddp_reducer_test.cpp), with caps 2000 / 600 bytes.
  std::vector<ParamSpec> ps = {P(300),           P(100),          P(0),  P(50, DType::F64), P(7, DType::F64),
                               P(40, DType::BF16), P(3, DType::F16), P(20000), P(120), P(1)};
  auto plan = plan_buckets(ps, {.cap_bytes = 2000, .first_cap_bytes = 600});
  ASSERT_EQ(plan.size(), 6u);
  EXPECT_EQ(plan[0].params, (Idx{9, 8}));
  EXPECT_EQ(plan[1].params, (Idx{7}));
  EXPECT_EQ(plan[2].params, (Idx{6}));
  EXPECT_EQ(plan[3].params, (Idx{5}));
  EXPECT_EQ(plan[4].params, (Idx{4, 3}));
  EXPECT_EQ(plan[4].offsets, (Idx{0, 7}));
  EXPECT_EQ(plan[5].params, (Idx{2, 1, 0}));  // the zero-size f32 parameter with its dtype's bucket
  EXPECT_EQ(plan[5].offsets, (Idx{0, 0, 100}));
}

TEST(BucketPlan, InvalidDtypeThrows) {
  std::vector<ParamSpec> ps = {P(3, static_cast<DType>(77))};
  EXPECT_THROW(plan_buckets(ps), InvalidArgument);
}

// Invariants on random models: each parameter exactly once, descending
// within a bucket, contiguous offsets, one dtype per bucket, caps respected
// unless alone (each dtype's first bucket has the first cap), buckets listed
// in the order their last parameter comes in the reverse walk.
TEST(BucketPlan, RandomModelsKeepTheInvariants) {
  std::mt19937 rng(7);
  const DType types[] = {DType::F32, DType::F64, DType::F16, DType::BF16};
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<ParamSpec> ps(rng() % 40);
    for (auto& p : ps) p = P(rng() % 4 == 0 ? 0 : rng() % 3000, types[rng() % (trial % 2 ? 4 : 1)]);
    const BucketPlanOptions o{.cap_bytes = 1 + rng() % 8000, .first_cap_bytes = rng() % 3000};
    auto plan = plan_buckets(ps, o);
    std::vector<int> seen(ps.size(), 0);
    std::map<DType, size_t> per_dtype;
    size_t prev_last = ps.size() + 1;  // the previous bucket's last (smallest) index
    for (size_t b = 0; b < plan.size(); ++b) {
      const auto& bk = plan[b];
      ASSERT_EQ(bk.params.size(), bk.offsets.size());
      ASSERT_FALSE(bk.params.empty());
      size_t off = 0, nonzero = 0;
      for (size_t k = 0; k < bk.params.size(); ++k) {
        if (k > 0) {
          ASSERT_LT(bk.params[k], bk.params[k - 1]) << "trial " << trial;
        }
        ++seen.at(bk.params[k]);
        ASSERT_EQ(bk.offsets[k], off);
        const ParamSpec& p = ps[bk.params[k]];
        off += p.count;
        ASSERT_EQ(p.dtype, bk.dtype) << "trial " << trial << " bucket " << b;
        if (p.count > 0) ++nonzero;
      }
      ASSERT_EQ(bk.count, off);
      ASSERT_LT(bk.params.back(), prev_last) << "trial " << trial << ": bucket " << b << " completes earlier";
      prev_last = bk.params.back();
      // Buckets of a dtype complete in walk order, so the first listed is its first.
      const size_t cap = per_dtype[bk.dtype]++ == 0 ? o.first_cap_bytes : o.cap_bytes;
      if (nonzero > 1) {
        ASSERT_LE(bk.bytes(), cap) << "trial " << trial << " bucket " << b;
      }
    }
    for (size_t i = 0; i < ps.size(); ++i) ASSERT_EQ(seen[i], 1) << "trial " << trial << " parameter " << i;
  }
}

}  // namespace
}  // namespace cohort::ddp
