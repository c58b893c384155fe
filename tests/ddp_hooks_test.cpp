// Comm hooks: fp16 / bf16 compression, a custom hook, hook errors. Ranks as
// threads over shm and tcp, world sizes 1..4, closed-form expected values.
#include <atomic>
#include <algorithm>
#include <cmath>
#include <limits>

#include "ddp_test_util.hpp"

namespace cohort::ddp {
namespace {

using namespace test;
using cohort::testing::run_ranks;

class HookTest : public ::testing::TestWithParam<Config> {};

// The mixed model (f32, f64, bf16 and f16 buckets) through a compression
// hook: small integers and their averages survive compression exactly.
void expect_exact_average(const Config& c, CommHook hook, const char* what) {
  run_ranks(c.world, c.transport, [&](ProcessGroup& pg) {
    const int r = pg.rank(), n = pg.size();
    Grads g(mixed_model());
    ReducerOptions o = small_buckets();
    o.comm_hook = hook;
    Reducer red(pg, g.specs, o);
    for (int t = 0; t < 2; ++t) {
      g.fill([&](size_t p, size_t i) { return grad_value(r, p, i, t); });
      for (size_t p : shuffled(g.specs.size(), 5 * r + t)) red.mark_ready(p, g.ptr(p));
      red.finalize();
      expect_values(g.specs, r, what, [&](size_t p, size_t i) { return g.at(p, i); },
                    [&](size_t p, size_t i) { return avg_value(n, p, i, t); });
    }
  });
}

// A value that f32 holds but the compressed type rounds away: the result shows
// that the bytes really travelled compressed.
void expect_rounded(const Config& c, CommHook hook, float fine, float coarse) {
  run_ranks(c.world, c.transport, [&](ProcessGroup& pg) {
    std::vector<float> w(1000, fine);
    ReducerOptions o;
    o.comm_hook = hook;
    Reducer red(pg, {{"w", w.size(), DType::F32, w.data()}}, o);
    red.mark_ready(0, w.data());
    red.finalize();
    for (size_t i = 0; i < w.size(); ++i) ASSERT_EQ(w[i], coarse) << "rank " << pg.rank() << " element " << i;
  });
}

TEST_P(HookTest, Fp16CompressionAverages) {
  expect_exact_average(GetParam(), fp16_compress_hook(), "fp16 hook");
  expect_rounded(GetParam(), fp16_compress_hook(), 1.0f + 1.0f / 4096, 1.0f);  // below half an f16 ulp
}

TEST_P(HookTest, Bf16CompressionAverages) {
  expect_exact_average(GetParam(), bf16_compress_hook(), "bf16 hook");
  expect_rounded(GetParam(), bf16_compress_hook(), 1.0f + 1.0f / 512, 1.0f);  // below half a bf16 ulp
}

TEST_P(HookTest, DefaultHookIsExactAverage) {
  expect_exact_average(GetParam(), allreduce_avg_hook(), "avg hook");
  expect_rounded(GetParam(), {}, 1.0f + 1.0f / 4096, 1.0f + 1.0f / 4096);
}

// A custom hook that sums instead of averaging, and records what it is given.
TEST_P(HookTest, CustomHookIsUsed) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    Grads g(mixed_model());
    std::vector<size_t> calls;
    int then_runs = 0;
    Reducer red(pg, g.specs, small_buckets());
    red.register_comm_hook([&](GradBucket& b) -> CommFuture {
      calls.push_back(b.index());
      EXPECT_EQ(b.is_last(), b.index() + 1 == kMixedBuckets);
      EXPECT_EQ(b.buffer().count, red.plan()[b.index()].count);
      EXPECT_EQ(std::vector<size_t>(b.params().begin(), b.params().end()), red.plan()[b.index()].params);
      return {b.group().allreduce(b.buffer(), {.op = ReduceOp::Sum}), [&] { ++then_runs; }};
    });
    for (int t = 0; t < 2; ++t) {
      g.fill([&](size_t p, size_t i) { return grad_value(r, p, i, t); });
      for (size_t p : shuffled(g.specs.size(), 3 * r + t)) red.mark_ready(p, g.ptr(p));
      red.finalize();
      expect_values(g.specs, r, "sum hook", [&](size_t p, size_t i) { return g.at(p, i); },
                    [&](size_t p, size_t i) { return sum_value(n, p, i, t); });
    }
    // Plan order, every iteration; the `then` ran in finalize.
    EXPECT_EQ(calls, (std::vector<size_t>{0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5}));
    EXPECT_EQ(then_runs, 12);
    EXPECT_THROW(red.register_comm_hook(allreduce_avg_hook()), InvalidArgument);  // too late
  });
}

// The `then` of a hook runs in finalize, not later: by the time finalize
// returns, the bucket holds the hook's final result.
TEST_P(HookTest, ThenRunsBeforeFinalizeReturns) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    std::vector<float> w(50, float(pg.rank() + 1));
    std::atomic<bool> then_ran{false};
    ReducerOptions o;
    o.comm_hook = [&](GradBucket& b) -> CommFuture {
      auto* data = static_cast<float*>(b.buffer().data);
      size_t count = b.buffer().count;
      return {b.group().allreduce(b.buffer(), {.op = ReduceOp::Sum}), [&then_ran, data, count] {
                for (size_t i = 0; i < count; ++i) data[i] *= 2;
                then_ran = true;
              }};
    };
    Reducer red(pg, {{"w", w.size(), DType::F32, w.data()}}, o);
    red.mark_ready(0, w.data());
    EXPECT_FALSE(then_ran.load());
    red.finalize();
    EXPECT_TRUE(then_ran.load());
    for (float v : w) ASSERT_EQ(v, float(n * (n + 1)));  // 2 x sum
  });
}

TEST_P(HookTest, CompressionRejectsIntegerBuckets) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    std::vector<int32_t> w(8, 1);
    ReducerOptions o;
    o.comm_hook = fp16_compress_hook();
    Reducer red(pg, {{"steps", w.size(), DType::I32, w.data()}}, o);
    std::string m = error_of([&] { red.mark_ready(0, w.data()); });
    EXPECT_NE(m.find("fp16_compress_hook: bucket 0 holds i32 gradients"), std::string::npos) << m;
    // A failed hook leaves the ranks in an unknown state: the reducer refuses further work.
    m = error_of([&] { red.finalize(); });
    EXPECT_NE(m.find("can no longer be used"), std::string::npos) << m;
  });
}

// A hook of several steps (CommFuture::next): each step runs once the one
// before has completed, one step of every bucket per round, in bucket order.
TEST_P(HookTest, NextStepsRunInRoundsInBucketOrder) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    Grads g(mixed_model());
    std::vector<std::pair<size_t, int>> steps;  // (bucket, step) as they ran
    Reducer red(pg, g.specs, small_buckets());
    red.register_comm_hook([&](GradBucket& b) -> CommFuture {
      const Buffer buf = b.buffer();
      const size_t index = b.index();
      steps.emplace_back(index, 1);
      ProcessGroup* group = &b.group();
      return {group->allreduce(buf, {.op = ReduceOp::Sum}), nullptr, [&steps, group, buf, index]() -> CommFuture {
                steps.emplace_back(index, 2);
                // Sums again: n times the sum, which only a second collective on the first's result gives.
                return {group->allreduce(buf, {.op = ReduceOp::Sum}), [&steps, index] { steps.emplace_back(index, 3); },
                        nullptr};
              }};
    });
    g.fill([&](size_t p, size_t i) { return grad_value(r, p, i, 0); });
    for (size_t p : shuffled(g.specs.size(), 7 * r)) red.mark_ready(p, g.ptr(p));
    red.finalize();
    expect_values(g.specs, r, "two-step hook", [&](size_t p, size_t i) { return g.at(p, i); },
                  [&](size_t p, size_t i) { return n * sum_value(n, p, i, 0); });
    std::vector<std::pair<size_t, int>> want;
    for (int step = 1; step <= 3; ++step)
      for (size_t b = 0; b < kMixedBuckets; ++b) want.emplace_back(b, step);
    EXPECT_EQ(steps, want);
  });
}

// int8_compress_hook on f32 gradients of every rank drawn from [-1, 1].
struct Int8Run {
  std::vector<std::vector<float>> results;  // per step
  std::vector<float> truth;                 // the exact average of one step
};

// `steps` synced iterations with the same gradients; rank r's gradient at i
// is wave(r, i), except that element 0 is `tiny` on every rank.
Int8Run run_int8(ProcessGroup& pg, size_t count, int steps, float tiny) {
  const int n = pg.size(), r = pg.rank();
  auto wave = [](int rank, size_t i) { return std::sin(0.37f * float(i) + 1.3f * float(rank)); };
  std::vector<float> w(count);
  ReducerOptions o;
  o.comm_hook = int8_compress_hook();
  Reducer red(pg, {{"w", w.size(), DType::F32, w.data()}}, o);
  Int8Run out;
  out.truth.resize(count);
  for (size_t i = 0; i < count; ++i) {
    double sum = 0;
    for (int k = 0; k < n; ++k) sum += i == 0 ? tiny : wave(k, i);
    out.truth[i] = float(sum / n);
  }
  for (int t = 0; t < steps; ++t) {
    for (size_t i = 0; i < count; ++i) w[i] = i == 0 ? tiny : wave(r, i);
    red.mark_ready(0, w.data());
    red.finalize();
    out.results.push_back(w);
  }
  return out;
}

TEST_P(HookTest, Int8StaysWithinTwoHalfStepsAndIsTheSameOnEveryRank) {
  auto [transport, n] = GetParam();
  std::vector<std::vector<float>> first(n);
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    Int8Run run = run_int8(pg, 1001, 1, 0.5f);
    // Each quantisation moves an element by at most half a step (scale / 2,
    // scale = max |x| / 127 <= 1 / 127): once on the way out, once after averaging.
    const float bound = 1.0f / 127 * 1.01f;
    for (size_t i = 0; i < run.truth.size(); ++i)
      ASSERT_LE(std::fabs(run.results[0][i] - run.truth[i]), bound) << "rank " << pg.rank() << " element " << i;
    first[pg.rank()] = run.results[0];
  });
  for (int r = 1; r < n; ++r) EXPECT_EQ(first[r], first[0]) << "rank " << r << " differs from rank 0";
}

// Error feedback: an element below half a step is rounded to zero at every
// step, but what rounding lost is carried into the next step, so over 40
// steps the sum of the results follows 40 times the true average (without
// feedback it would stay at zero).
TEST_P(HookTest, Int8ErrorFeedbackCarriesWhatRoundingLost) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    const float tiny = 1.0f / 127 / 8;  // an eighth of a step
    const int steps = 40;
    Int8Run run = run_int8(pg, 301, steps, tiny);
    std::vector<double> sum(run.truth.size(), 0.0);
    for (const auto& res : run.results)
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += res[i];
    for (size_t i = 0; i < sum.size(); ++i)
      ASSERT_NEAR(sum[i], steps * double(run.truth[i]), 2.0 / 127) << "rank " << pg.rank() << " element " << i;
    EXPECT_GT(sum[0], 0.5 * steps * tiny);
  });
}

// An inf (a GradScaler step to skip) shows in the result as non-finite, and
// the next step is finite again: the errors did not keep it.
TEST_P(HookTest, Int8PassesAnInfOnAndRecovers) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    std::vector<float> w(64);
    ReducerOptions o;
    o.comm_hook = int8_compress_hook();
    Reducer red(pg, {{"w", w.size(), DType::F32, w.data()}}, o);
    for (int t = 0; t < 3; ++t) {
      for (size_t i = 0; i < w.size(); ++i) w[i] = 0.5f + 0.01f * float(i);
      if (t == 1 && pg.rank() == 0) w[3] = std::numeric_limits<float>::infinity();
      red.mark_ready(0, w.data());
      red.finalize();
      const bool finite = std::all_of(w.begin(), w.end(), [](float v) { return std::isfinite(v); });
      EXPECT_EQ(finite, t != 1) << "rank " << pg.rank() << " step " << t;
      if (t == 2) {
        for (size_t i = 0; i < w.size(); ++i) ASSERT_NEAR(w[i], 0.5f + 0.01f * float(i), 2.0f / 127) << i;
      }
    }
  });
}

// A chunk so small that 1 / scale would overflow is sent as zeros and kept
// whole as error (no undefined conversion of inf to int).
TEST_P(HookTest, Int8SendsATinyChunkAsZeros) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    std::vector<float> w(40, 1e-39f);
    ReducerOptions o;
    o.comm_hook = int8_compress_hook();
    Reducer red(pg, {{"w", w.size(), DType::F32, w.data()}}, o);
    red.mark_ready(0, w.data());
    red.finalize();
    for (float v : w) ASSERT_EQ(v, 0.f) << "rank " << pg.rank();
  });
}

TEST_P(HookTest, Int8RefusesOtherDtypesByName) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    std::vector<double> w(8, 1.0);
    ReducerOptions o;
    o.comm_hook = int8_compress_hook();
    Reducer red(pg, {{"w", w.size(), DType::F64, w.data()}}, o);
    std::string m = error_of([&] { red.mark_ready(0, w.data()); });
    EXPECT_NE(m.find("int8_compress_hook: bucket 0 holds f64 gradients; it quantises f32 buckets"), std::string::npos)
        << m;
  });
}

INSTANTIATE_TEST_SUITE_P(All, HookTest, ::testing::ValuesIn(configs()), config_name);

}  // namespace
}  // namespace cohort::ddp
