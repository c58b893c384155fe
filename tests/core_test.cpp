// Pure functions: reduction kernels, half conversions, env parsing, the tuner.
#include <gtest/gtest.h>

#include <algorithm>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cohort/cohort.hpp"
#include "collectives/tuner.hpp"
#include "core/clock.hpp"
#include "core/env.hpp"
#include "core/reduce.hpp"
#include "core/stream_copy.hpp"

namespace cohort {
namespace {

TEST(Half, RoundTripsEveryFiniteHalf) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00) == 0x7c00) continue;  // inf / nan
    float f = core::half_to_float(static_cast<uint16_t>(h));
    EXPECT_EQ(core::float_to_half(f), h) << "half bits " << h;
  }
}

TEST(Half, RoundsToNearestEven) {
  EXPECT_EQ(core::half_to_float(core::float_to_half(1.0f + 1.0f / 2048)), 1.0f);          // tie -> even (down)
  EXPECT_EQ(core::half_to_float(core::float_to_half(1.0f + 3.0f / 2048)), 1.0f + 4.0f / 2048);  // tie -> even (up)
  EXPECT_EQ(core::half_to_float(core::float_to_half(70000.0f)), std::numeric_limits<float>::infinity());
  EXPECT_EQ(core::half_to_float(core::float_to_half(65504.0f)), 65504.0f);
  EXPECT_EQ(core::half_to_float(core::float_to_half(std::ldexp(1.0f, -24))), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_TRUE(std::isnan(core::half_to_float(core::float_to_half(NAN))));
}

TEST(Bf16, RoundTripAndRounding) {
  for (uint32_t b = 0; b < 0x10000; b += 7) {
    if ((b & 0x7f80) == 0x7f80) continue;
    EXPECT_EQ(core::float_to_bf16(core::bf16_to_float(static_cast<uint16_t>(b))), b);
  }
  EXPECT_EQ(core::bf16_to_float(core::float_to_bf16(257.0f)), 256.0f);  // tie -> even
  EXPECT_EQ(core::bf16_to_float(core::float_to_bf16(259.0f)), 260.0f);
}

TEST(Reduce, EveryOpOnFloatsAndInts) {
  float a[5] = {1, -2, 3, 4, 5}, b[5] = {2, 2, -1, 4, 0.5f}, d[5];
  core::reduce(d, a, b, 5, DType::F32, ReduceOp::Sum);
  EXPECT_EQ(d[1], 0.0f);
  core::reduce(d, a, b, 5, DType::F32, ReduceOp::Prod);
  EXPECT_EQ(d[4], 2.5f);
  core::reduce(d, a, b, 5, DType::F32, ReduceOp::Min);
  EXPECT_EQ(d[2], -1.0f);
  core::reduce(d, a, b, 5, DType::F32, ReduceOp::Max);
  EXPECT_EQ(d[0], 2.0f);
  int8_t x[2] = {100, -100}, y[2] = {100, -100}, z[2];
  core::reduce(z, x, y, 2, DType::I8, ReduceOp::Sum);  // wraps, like NCCL and MPI
  EXPECT_EQ(z[0], static_cast<int8_t>(200));
  int64_t avg[3] = {7, 8, -9};
  core::scale_avg(avg, 3, DType::I64, 2);
  EXPECT_EQ(avg[0], 3);
  EXPECT_EQ(avg[2], -4);
  // In place (dst aliases a) is allowed.
  core::reduce(a, a, b, 5, DType::F32, ReduceOp::Sum);
  EXPECT_EQ(a[0], 3.0f);
}

TEST(Reduce, HalfTypesReduceInFloat) {
  uint16_t a = core::float_to_half(1.5f), b = core::float_to_half(2.25f), d;
  core::reduce(&d, &a, &b, 1, DType::F16, ReduceOp::Sum);
  EXPECT_EQ(core::half_to_float(d), 3.75f);
  uint16_t p = core::float_to_bf16(3.0f), q = core::float_to_bf16(-2.0f), r;
  core::reduce(&r, &p, &q, 1, DType::BF16, ReduceOp::Prod);
  EXPECT_EQ(core::bf16_to_float(r), -6.0f);
}

// The array conversions (F16C where the CPU has it) and the vectorised f16 /
// bf16 reductions must give exactly the scalar results for every non-NaN value:
// each half value, floats around the rounding ties, subnormals and overflow,
// at counts that are not a multiple of the vector width.
std::vector<float> awkward_floats() {
  std::vector<float> v;
  for (uint32_t h = 0; h < 0x10000; ++h)
    if ((h & 0x7c00) != 0x7c00) v.push_back(core::half_to_float(static_cast<uint16_t>(h)));
  for (int e = -30; e <= 20; ++e)
    for (float m : {1.0f, 1.0f + 1.0f / 2048, 1.0f + 3.0f / 2048, 1.5f, 1.9999f}) v.push_back(std::ldexp(m, e));
  for (float f : {65504.0f, 65519.0f, 65520.0f, 70000.0f, 1e30f, -1e-30f, 0.0f, -0.0f,
                  std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()})
    v.push_back(f);
  v.push_back(0.1f);  // a tail that is not a multiple of 8
  return v;
}

TEST(Half, ArrayConversionsMatchTheScalarOnes) {
  const std::vector<float> src = awkward_floats();
  for (DType half : {DType::F16, DType::BF16}) {
    std::vector<uint16_t> h(src.size());
    core::floats_to_half(src.data(), h.data(), src.size(), half);
    std::vector<float> back(src.size());
    core::half_to_floats(h.data(), back.data(), h.size(), half, 3.0f);
    for (size_t i = 0; i < src.size(); ++i) {
      const bool f16 = half == DType::F16;
      const uint16_t want = f16 ? core::float_to_half(src[i]) : core::float_to_bf16(src[i]);
      ASSERT_EQ(h[i], want) << dtype_name(half) << " of " << src[i] << " (element " << i << ")";
      const float want_back = (f16 ? core::half_to_float(want) : core::bf16_to_float(want)) / 3.0f;
      ASSERT_EQ(std::memcmp(&back[i], &want_back, 4), 0) << dtype_name(half) << " back from " << src[i];
    }
  }
  uint16_t nan_half = 0;
  const float nan = NAN;
  core::floats_to_half(&nan, &nan_half, 1, DType::F16);
  EXPECT_TRUE(std::isnan(core::half_to_float(nan_half)));
}

// Min and Max keep a NaN from either operand, so that ranks combining the same
// data in different orders (recursive doubling: "mine op theirs" on both
// sides) all end with NaN. Vector parts (n >= 8) and scalar tails, every float type.
TEST(Reduce, MinAndMaxPropagateANaNFromEitherSide) {
  const size_t n = 19;
  for (DType t : {DType::F32, DType::F64, DType::F16, DType::BF16})
    for (ReduceOp op : {ReduceOp::Min, ReduceOp::Max})
      for (size_t at : {size_t{0}, size_t{9}, size_t{18}})
        for (bool nan_left : {true, false}) {
          std::vector<float> fa(n, 2.0f), fb(n, 3.0f);
          (nan_left ? fa : fb)[at] = NAN;
          const size_t es = dtype_size(t);
          std::vector<uint8_t> a(n * es), b(n * es), d(n * es);
          auto put = [&](const std::vector<float>& f, std::vector<uint8_t>& out) {
            if (t == DType::F32) std::memcpy(out.data(), f.data(), n * 4);
            if (t == DType::F64)
              for (size_t i = 0; i < n; ++i) reinterpret_cast<double*>(out.data())[i] = f[i];
            if (t == DType::F16 || t == DType::BF16) core::floats_to_half(f.data(), reinterpret_cast<uint16_t*>(out.data()), n, t);
          };
          put(fa, a);
          put(fb, b);
          core::reduce(d.data(), a.data(), b.data(), n, t, op);
          auto get = [&](size_t i) -> double {
            if (t == DType::F32) return reinterpret_cast<float*>(d.data())[i];
            if (t == DType::F64) return reinterpret_cast<double*>(d.data())[i];
            const uint16_t h = reinterpret_cast<uint16_t*>(d.data())[i];
            return t == DType::F16 ? core::half_to_float(h) : core::bf16_to_float(h);
          };
          EXPECT_TRUE(std::isnan(get(at))) << dtype_name(t) << (op == ReduceOp::Min ? " min" : " max") << " element "
                                           << at << (nan_left ? " NaN on the left" : " NaN on the right");
          EXPECT_EQ(get(at == 0 ? 1 : 0), op == ReduceOp::Min ? 2.0 : 3.0) << dtype_name(t);
        }
}

TEST(Reduce, VectorisedHalfReductionsMatchTheScalarOnes) {
  const std::vector<float> fa = awkward_floats();
  std::vector<float> fb(fa.rbegin(), fa.rend());  // pairs every value with another
  for (DType half : {DType::F16, DType::BF16}) {
    const bool f16 = half == DType::F16;
    std::vector<uint16_t> a(fa.size()), b(fa.size()), d(fa.size());
    for (size_t i = 0; i < fa.size(); ++i) {
      a[i] = f16 ? core::float_to_half(fa[i]) : core::float_to_bf16(fa[i]);
      b[i] = f16 ? core::float_to_half(fb[i]) : core::float_to_bf16(fb[i] * 0.75f);
    }
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max}) {
      core::reduce(d.data(), a.data(), b.data(), a.size(), half, op);
      for (size_t i = 0; i < a.size(); ++i) {
        const float x = f16 ? core::half_to_float(a[i]) : core::bf16_to_float(a[i]);
        const float y = f16 ? core::half_to_float(b[i]) : core::bf16_to_float(b[i]);
        float r = 0;
        switch (op) {
          case ReduceOp::Sum: r = x + y; break;
          case ReduceOp::Prod: r = x * y; break;
          case ReduceOp::Min: r = y < x ? y : x; break;
          default: r = x < y ? y : x; break;
        }
        if (std::isnan(r)) {  // inf - inf, 0 * inf: any NaN will do
          const float got = f16 ? core::half_to_float(d[i]) : core::bf16_to_float(d[i]);
          ASSERT_TRUE(std::isnan(got)) << "element " << i;
          continue;
        }
        const uint16_t want = f16 ? core::float_to_half(r) : core::float_to_bf16(r);
        ASSERT_EQ(d[i], want) << dtype_name(half) << " op " << static_cast<int>(op) << ": " << x << ", " << y;
      }
    }
  }
}

// Streaming stores need a 16-byte aligned destination: every head and tail
// length around it, and sizes around the 64-byte step.
TEST(StreamCopy, CopiesEveryAlignmentAndLength) {
  std::vector<uint8_t> src(300000 + 64), dst(src.size() + 64);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + i / 251);
  for (size_t len : {size_t(0), size_t(1), size_t(15), size_t(16), size_t(63), size_t(64), size_t(65), size_t(129),
                     size_t(300000)})
    for (size_t d_off = 0; d_off < 18; ++d_off)
      for (size_t s_off : {size_t(0), size_t(1), size_t(9)}) {
        std::fill(dst.begin(), dst.end(), uint8_t{0xAB});
        core::stream_copy(dst.data() + d_off, src.data() + s_off, len);
        core::stream_fence();
        for (size_t i = 0; i < dst.size(); ++i) {
          const bool inside = i >= d_off && i < d_off + len;
          ASSERT_EQ(dst[i], inside ? src[s_off + i - d_off] : uint8_t{0xAB})
              << "len " << len << " dst offset " << d_off << " src offset " << s_off << " byte " << i;
        }
      }
  EXPECT_GE(core::stream_copy_min(), size_t{4} << 20);
  // A guest may see its host's whole L3 (480 MiB on one VM): the threshold stays at most 32 MiB.
  if (core::stream_copy_min() != SIZE_MAX) {
    EXPECT_LE(core::stream_copy_min(), size_t{32} << 20);
  }
}

TEST(Env, ParsesSizesAndDurations) {
  EXPECT_EQ(core::parse_bytes("4096"), 4096u);
  EXPECT_EQ(core::parse_bytes("64K"), 65536u);
  EXPECT_EQ(core::parse_bytes("1MiB"), 1u << 20);
  EXPECT_EQ(core::parse_bytes("2g"), 2ull << 30);
  EXPECT_FALSE(core::parse_bytes("lots"));
  EXPECT_FALSE(core::parse_bytes("-3"));
  EXPECT_DOUBLE_EQ(*core::parse_seconds("500ms"), 0.5);
  EXPECT_DOUBLE_EQ(*core::parse_seconds("5m"), 300.0);
  EXPECT_FALSE(core::parse_seconds("soon"));
  EXPECT_FALSE(core::parse_seconds("inf"));  // strtod reads these; a timeout cannot use them
  EXPECT_FALSE(core::parse_seconds("nan"));
  EXPECT_FALSE(core::parse_seconds("-5s"));
}

TEST(Env, DurationKnobsInMillisecondsRoundUpAndSaturate) {
  static const core::Knob k{"COHORT_TEST_ONLY_DURATION", "2s", "a duration knob that only this test reads",
                            core::KnobKind::Seconds};
  EXPECT_EQ(k.millis(), std::chrono::milliseconds(2000));
  setenv("COHORT_TEST_ONLY_DURATION", "500us", 1);  // not 0 ms: that would mean "time out at once"
  EXPECT_EQ(k.millis(), std::chrono::milliseconds(1));
  setenv("COHORT_TEST_ONLY_DURATION", "1e300", 1);
  EXPECT_EQ(k.millis(), core::kLongestWait);
  setenv("COHORT_TEST_ONLY_DURATION", "inf", 1);
  EXPECT_THROW((void)k.millis(), InvalidArgument);
  unsetenv("COHORT_TEST_ONLY_DURATION");
}

TEST(Clock, DeadlinesTooFarAwayNeverPass) {
  // milliseconds::max() in nanoseconds overflows; the deadline must not land in the past.
  EXPECT_FALSE(core::Deadline::after(std::chrono::milliseconds::max()).passed());
  EXPECT_FALSE(core::Deadline::after(std::chrono::duration<double>(1e300)).passed());
  EXPECT_FALSE(core::Deadline::after(core::kLongestWait).passed());
  EXPECT_GT(core::Deadline::after(core::kLongestWait).remaining_ms(), 1000000);
  EXPECT_TRUE(core::Deadline::after(std::chrono::milliseconds(-1)).passed());
}

TEST(Env, BadKnobValueNamesTheKnob) {
  static const core::Knob k{"COHORT_TEST_ONLY_KNOB", "1", "a knob that only this test reads", core::KnobKind::Int};
  setenv("COHORT_TEST_ONLY_KNOB", "many", 1);
  try {
    (void)k.integer();
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("COHORT_TEST_ONLY_KNOB=many"), std::string::npos) << e.what();
  }
  unsetenv("COHORT_TEST_ONLY_KNOB");
}

// A set value that does not parse is reported by problem() and
// knob_problems() (what `cohort env` marks INVALID and `cohort run` refuses),
// whatever the knob's kind; a plain string knob never is.
TEST(Env, ProblemsNameEveryKnobThatDoesNotParse) {
  static const core::Knob d{"COHORT_TEST_ONLY_PROBLEM_SECONDS", "1s", "a duration knob only this test reads",
                            core::KnobKind::Seconds};
  static const core::Knob b{"COHORT_TEST_ONLY_PROBLEM_BOOL", "0", "a boolean knob only this test reads",
                            core::KnobKind::Bool};
  static const core::Knob s{"COHORT_TEST_ONLY_PROBLEM_STRING", "", "a string knob only this test reads"};
  EXPECT_EQ(d.problem(), "") << "unset: the default";
  setenv("COHORT_TEST_ONLY_PROBLEM_SECONDS", "abc", 1);
  setenv("COHORT_TEST_ONLY_PROBLEM_BOOL", "maybe", 1);
  setenv("COHORT_TEST_ONLY_PROBLEM_STRING", "anything", 1);
  EXPECT_NE(d.problem().find("COHORT_TEST_ONLY_PROBLEM_SECONDS=abc is not a duration"), std::string::npos) << d.problem();
  EXPECT_NE(b.problem().find("COHORT_TEST_ONLY_PROBLEM_BOOL=maybe is not a boolean"), std::string::npos) << b.problem();
  EXPECT_EQ(s.problem(), "");
  const auto all = core::knob_problems();
  const auto has = [&](const char* name) {
    return std::any_of(all.begin(), all.end(), [&](const std::string& p) { return p.find(name) != std::string::npos; });
  };
  EXPECT_TRUE(has("COHORT_TEST_ONLY_PROBLEM_SECONDS"));
  EXPECT_TRUE(has("COHORT_TEST_ONLY_PROBLEM_BOOL"));
  EXPECT_FALSE(has("COHORT_TEST_ONLY_PROBLEM_STRING"));
  setenv("COHORT_TEST_ONLY_PROBLEM_SECONDS", "90s", 1);
  EXPECT_EQ(d.problem(), "");
  unsetenv("COHORT_TEST_ONLY_PROBLEM_SECONDS");
  unsetenv("COHORT_TEST_ONLY_PROBLEM_BOOL");
  unsetenv("COHORT_TEST_ONLY_PROBLEM_STRING");
}

TEST(Env, EveryKnobIsDocumentedAndNamedCohort) {
  auto knobs = core::all_knobs();
  EXPECT_GT(knobs.size(), 8u);
  for (const auto* k : knobs) {
    EXPECT_EQ(std::string(k->name()).rfind("COHORT_", 0), 0u) << k->name();
    EXPECT_GT(std::strlen(k->help()), 10u) << k->name();
  }
}

TEST(Tuner, SmallAllreduceIsLatencyOptimalLargeIsRing) {
  using namespace collectives;
  EXPECT_EQ(choose({Coll::Allreduce, 8, 2, true}), Algo::RecursiveDoubling);
  EXPECT_EQ(choose({Coll::Allreduce, 64 << 20, 2, true}), Algo::Ring);
  EXPECT_EQ(choose({Coll::Allreduce, 64 << 20, 8, false}), Algo::Ring);
  EXPECT_EQ(choose({Coll::Broadcast, 64 << 20, 8, true}), Algo::Pipeline);
  EXPECT_EQ(choose({Coll::Broadcast, 8, 8, true}), Algo::Binomial);
}

TEST(Tuner, SingleCopyFromItsThresholdWhenTheGroupHasIt) {
  using namespace collectives;
  EXPECT_EQ(choose({Coll::Allreduce, 1 << 20, 2, true, true}), Algo::SingleCopy);
  // From 256 KiB single copy too, which runs the ring unless every rank's buffers are shared.
  EXPECT_EQ(choose({Coll::Allreduce, 256 << 10, 2, true, true}), Algo::SingleCopy);
  EXPECT_EQ(choose({Coll::Allreduce, (256 << 10) - 4, 2, true, true}), Algo::Ring);
  Thresholds no_shared;
  no_shared.allreduce_single_copy_shared_min = 0;
  EXPECT_EQ(choose({Coll::Allreduce, (1 << 20) - 4, 2, true, true}, no_shared), Algo::Ring);
  EXPECT_EQ(choose({Coll::Allreduce, 1 << 20, 2, true, true}, no_shared), Algo::SingleCopy);
  EXPECT_EQ(choose({Coll::Allreduce, 8, 4, true, true}), Algo::RecursiveDoubling);
  EXPECT_EQ(choose({Coll::Allreduce, 64 << 20, 2, true, false}), Algo::Ring);  // the kernel said no
  Thresholds off;
  off.allreduce_single_copy_min = 0;
  EXPECT_EQ(choose({Coll::Allreduce, 64 << 20, 2, true, true}, off), Algo::Ring);
  EXPECT_EQ(choose({Coll::Broadcast, 64 << 20, 8, true, true}), Algo::Pipeline);  // not for broadcast
  EXPECT_EQ(override_from_env(Coll::Allreduce, "allreduce=single_copy"), Algo::SingleCopy);
  EXPECT_THROW(override_from_env(Coll::Broadcast, "broadcast=single_copy"), InvalidArgument);
}

TEST(Tuner, AllgatherAndReduceScatterBySingleCopyOnSharedBuffers) {
  using namespace collectives;
  // From the shared-buffer threshold (256 KiB) on the whole buffer; the group
  // then runs it only when every rank's input is a shared buffer (shared_only).
  // allgather: the tuner gets one rank's block.
  EXPECT_EQ(choose({Coll::Allgather, 128 << 10, 2, true, true}), Algo::SingleCopy);
  EXPECT_EQ(choose({Coll::Allgather, (128 << 10) - 4, 2, true, true}), Algo::Ring);
  EXPECT_EQ(choose({Coll::Allgather, 64 << 10, 4, true, true}), Algo::SingleCopy);
  EXPECT_EQ(choose({Coll::Allgather, 8 << 10, 2, true, true}), Algo::Direct);
  EXPECT_EQ(choose({Coll::Allgather, 64 << 20, 2, true, false}), Algo::Ring);  // the kernel said no
  // reduce_scatter: the tuner gets the whole input.
  EXPECT_EQ(choose({Coll::ReduceScatter, 256 << 10, 2, true, true}), Algo::SingleCopy);
  EXPECT_EQ(choose({Coll::ReduceScatter, (256 << 10) - 4, 2, true, true}), Algo::Ring);
  EXPECT_EQ(choose({Coll::ReduceScatter, 64 << 20, 3, false, false}), Algo::Ring);  // a peer over tcp
  Thresholds off, no_shared;
  off.allreduce_single_copy_min = 0;
  no_shared.allreduce_single_copy_shared_min = 0;
  for (const Thresholds& t : {off, no_shared}) {
    EXPECT_EQ(choose({Coll::Allgather, 128 << 10, 2, true, true}, t), Algo::Ring);
    EXPECT_EQ(choose({Coll::ReduceScatter, 64 << 20, 2, true, true}, t), Algo::Ring);
  }
  // allgather from allreduce_single_copy_min (1 MiB of output) on any buffers: with or without the
  // shared-buffer threshold, not with single copy off; the group does not ask for shared buffers there.
  EXPECT_EQ(choose({Coll::Allgather, 512 << 10, 2, true, true}, no_shared), Algo::SingleCopy);
  EXPECT_EQ(choose({Coll::Allgather, 64 << 20, 2, true, true}, off), Algo::Ring);
  EXPECT_TRUE(single_copy_shared_only(Coll::Allgather, (1 << 20) - 1, Thresholds{}));
  EXPECT_FALSE(single_copy_shared_only(Coll::Allgather, 1 << 20, Thresholds{}));
  EXPECT_TRUE(single_copy_shared_only(Coll::ReduceScatter, 64 << 20, Thresholds{}));
  EXPECT_FALSE(single_copy_shared_only(Coll::Allreduce, 1 << 20, Thresholds{}));
  EXPECT_EQ(override_from_env(Coll::ReduceScatter, "reduce_scatter=single_copy"), Algo::SingleCopy);
  EXPECT_EQ(override_from_env(Coll::Allgather, "single_copy"), Algo::SingleCopy);  // a bare name where it applies
}

TEST(Tuner, EnvOverride) {
  using namespace collectives;
  EXPECT_EQ(override_from_env(Coll::Allreduce, "ring"), Algo::Ring);
  EXPECT_EQ(override_from_env(Coll::Broadcast, "ring"), std::nullopt);  // bare names apply where they can
  EXPECT_EQ(override_from_env(Coll::Broadcast, "allreduce=ring,broadcast=pipeline"), Algo::Pipeline);
  EXPECT_EQ(override_from_env(Coll::Allreduce, ""), std::nullopt);
  EXPECT_THROW(override_from_env(Coll::Allreduce, "fastest"), InvalidArgument);
  EXPECT_THROW(override_from_env(Coll::Broadcast, "broadcast=ring"), InvalidArgument);
}

TEST(Dtype, NamesAndParsing) {
  EXPECT_EQ(parse_dtype("float"), DType::F32);
  EXPECT_EQ(parse_dtype("BF16"), DType::BF16);
  EXPECT_EQ(parse_dtype("complex"), std::nullopt);
  EXPECT_EQ(parse_reduce_op("mean"), ReduceOp::Avg);
  EXPECT_EQ(dtype_size(DType::I64), 8u);
  EXPECT_THROW(dtype_size(static_cast<DType>(42)), InvalidArgument);
}

}  // namespace
}  // namespace cohort
