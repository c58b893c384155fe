// powersgd_hook against PyTorch 2.13's powerSGD_hook on gloo
// (tests/data/powersgd_fixture.json, made by tests/data/gen_powersgd_fixture.py):
// the same gradients and the same first Q give the same averaged gradients to
// 1e-5, over 2 plain and 2 compressed iterations (error feedback and warm
// start included), at approximation ranks 1 and 4. Then what it sends, and
// its errors.
#include <cmath>
#include <fstream>

#include <nlohmann/json.hpp>

#include "ddp_test_util.hpp"

namespace cohort::ddp {
namespace {

using cohort::testing::run_ranks;

nlohmann::json fixture() {
  std::ifstream f(std::string(COHORT_TEST_DATA_DIR) + "/powersgd_fixture.json");
  return nlohmann::json::parse(f);
}

// As gen_powersgd_fixture.py: a part of rank 2 as a matrix, and one of full rank.
double grad(int rank, int step, size_t i) {
  const double x = double(i);
  return std::sin(0.013 * x * (step + 1) + rank) * (1.0 + 0.1 * rank) + 0.5 * std::sin(0.0007 * x * x + 0.2 * step + rank);
}

struct Shape {
  size_t rows, cols;
};

std::vector<Shape> shapes_of(const nlohmann::json& fx) {
  std::vector<Shape> out;
  for (const auto& s : fx["shapes"]) {
    size_t cols = 1;
    for (size_t d = 1; d < s.size(); ++d) cols *= s[d].get<size_t>();
    out.push_back({s[0].get<size_t>(), cols});
  }
  return out;
}

TEST(PowerSgd, MatchesPyTorchsPowerSgdHookAtRanks1And4) {
  const nlohmann::json fx = fixture();
  const std::vector<Shape> shapes = shapes_of(fx);
  const int start = fx["start"], steps = fx["steps"];
  for (int r : {1, 4}) {
    const auto& want = fx["results"][std::to_string(r)];
    run_ranks(2, "shm", [&](ProcessGroup& pg) {
      // Registered in reverse, so that the bucket (reverse registration order) lists them as the fixture does.
      std::vector<std::vector<float>> g(shapes.size());
      std::vector<ParamSpec> specs;
      for (size_t k = shapes.size(); k-- > 0;) {
        g[k].resize(shapes[k].rows * shapes[k].cols);
        const char name[] = {'p', char('0' + k), 0};  // (k < 10; a std::string sum here trips GCC 12's -Wrestrict)
        specs.push_back({name, g[k].size(), DType::F32, g[k].data(), shapes[k].rows});
      }
      size_t q_len = 0, total = 0;
      std::vector<size_t> offset(shapes.size());
      for (size_t k = 0; k < shapes.size(); ++k) {
        offset[k] = total;
        total += g[k].size();
        const size_t rk = std::min<size_t>({size_t(r), shapes[k].rows, shapes[k].cols});
        if ((shapes[k].rows + shapes[k].cols) * rk * 2 < shapes[k].rows * shapes[k].cols) q_len += shapes[k].cols * rk;
      }
      auto state = std::make_shared<PowerSgdState>(PowerSgdOptions{.rank = r, .start_iter = start});
      ReducerOptions o;
      o.comm_hook = powersgd_hook(state);
      Reducer red(pg, specs, o);
      ASSERT_EQ(red.plan().size(), 1u);
      for (int step = 0; step < steps; ++step) {
        for (size_t k = 0; k < shapes.size(); ++k)
          for (size_t i = 0; i < g[k].size(); ++i) g[k][i] = float(grad(pg.rank(), step, offset[k] + i));
        if (step == start) {
          state->q(0).resize(q_len);
          for (size_t i = 0; i < q_len; ++i) state->q(0)[i] = float(std::sin(0.1 * double(i) + 0.3) + 0.5 * std::sin(0.013 * double(i) * double(i) + 1.0));
        }
        for (size_t p = 0; p < specs.size(); ++p) red.mark_ready(p, specs[p].grad);
        red.finalize();
        double worst = 0;
        size_t worst_at = 0;
        for (size_t k = 0; k < shapes.size(); ++k)
          for (size_t i = 0; i < g[k].size(); ++i) {
            const double w = want[step][offset[k] + i].get<double>();
            const double err = std::fabs(g[k][i] - w) / std::max(1.0, std::fabs(w));
            if (err > worst) worst = err, worst_at = offset[k] + i;
          }
        EXPECT_LE(worst, 1e-5) << "rank " << r << " step " << step << " element " << worst_at << " (rank "
                               << pg.rank() << ")";
      }
      EXPECT_EQ(state->iteration(), steps);
    });
  }
}

// What crosses the wire for a compressed matrix is P and Q: (rows + cols) r
// elements instead of rows cols. A gradient of exact rank 1 comes back whole
// at r = 1 (nothing for error feedback to carry).
TEST(PowerSgd, ARankOneGradientSurvivesRankOneCompression) {
  run_ranks(2, "tcp", [&](ProcessGroup& pg) {
    const size_t rows = 40, cols = 30;
    std::vector<float> w(rows * cols);
    auto state = std::make_shared<PowerSgdState>(PowerSgdOptions{.rank = 1, .start_iter = 2});
    ReducerOptions o;
    o.comm_hook = powersgd_hook(state);
    Reducer red(pg, {{"w", w.size(), DType::F32, w.data(), rows}}, o);
    for (int step = 0; step < 4; ++step) {
      // u v^T scaled by the rank: the average is (1 + 2) / 2 u v^T.
      for (size_t i = 0; i < rows; ++i)
        for (size_t j = 0; j < cols; ++j) w[i * cols + j] = float((pg.rank() + 1) * (1.0 + 0.1 * i) * std::cos(0.2 * j));
      red.mark_ready(0, w.data());
      red.finalize();
      for (size_t i = 0; i < rows; ++i)
        for (size_t j = 0; j < cols; ++j)
          ASSERT_NEAR(w[i * cols + j], 1.5 * (1.0 + 0.1 * i) * std::cos(0.2 * j), 1e-4) << "step " << step;
    }
  });
}

// A gradient of rank 5 compressed at rank 5 comes back exactly averaged (the
// span of P is the span of the averaged matrix). 7 x 13 and rank 5 are not
// multiples of 4: the products' vector loops (4 doubles of the rank at a
// time, 4 rows or columns at a time) take every one of their remainders.
TEST(PowerSgd, ARankFiveGradientOfOddShapeSurvivesRankFiveCompression) {
  run_ranks(2, "shm", [&](ProcessGroup& pg) {
    const size_t rows = 7, cols = 13, r = 5;
    const auto exact = [&](int rank, size_t i, size_t j) {
      double s = 0;
      for (size_t k = 0; k < r; ++k) s += (rank + 1.0 + 0.5 * k) * std::sin(0.7 * (k + 1) * i + 0.1 * k) * std::cos(0.3 * (k + 2) * j);
      return s;
    };
    std::vector<float> w(rows * cols);
    auto state = std::make_shared<PowerSgdState>(
        PowerSgdOptions{.rank = static_cast<int>(r), .start_iter = 2, .min_compression_rate = 0.1});
    ReducerOptions o;
    o.comm_hook = powersgd_hook(state);
    Reducer red(pg, {{"w", w.size(), DType::F32, w.data(), rows}}, o);
    for (int step = 0; step < 5; ++step) {
      for (size_t i = 0; i < rows; ++i)
        for (size_t j = 0; j < cols; ++j) w[i * cols + j] = float(exact(pg.rank(), i, j));
      red.mark_ready(0, w.data());
      red.finalize();
      for (size_t i = 0; i < rows; ++i)
        for (size_t j = 0; j < cols; ++j)
          ASSERT_NEAR(w[i * cols + j], (exact(0, i, j) + exact(1, i, j)) / 2, 1e-4) << "step " << step << " at " << i << "," << j;
    }
  });
}

// Padding at the bucket's end (bucket_count_multiple, as ZeRO uses) belongs
// to no parameter: a 3 x 100 gradient stays a 3 x 100 matrix, and a gradient
// whose rows do not divide its count is averaged as it is.
TEST(PowerSgd, PaddedBucketsAndOddShapesKeepTheirMatrices) {
  run_ranks(2, "shm", [&](ProcessGroup& pg) {
    std::vector<float> w(300), odd(1001);
    auto state = std::make_shared<PowerSgdState>(PowerSgdOptions{.rank = 1, .start_iter = 2});
    ReducerOptions o;
    o.comm_hook = powersgd_hook(state);
    o.bucket_count_multiple = 8;
    o.first_bucket_mb = 64;
    // w registered first comes last in the bucket (reverse registration), right before the padding.
    Reducer red(pg, {{"w", w.size(), DType::F32, w.data(), 3}, {"odd", odd.size(), DType::F32, odd.data(), 10}}, o);
    ASSERT_EQ(red.plan().size(), 1u);
    for (int step = 0; step < 4; ++step) {
      for (size_t i = 0; i < 3; ++i)
        for (size_t j = 0; j < 100; ++j) w[i * 100 + j] = float((pg.rank() + 1) * (1.0 + i) * std::sin(0.1 * j));
      for (size_t i = 0; i < odd.size(); ++i) odd[i] = float(pg.rank() * 2 + std::cos(0.01 * i));
      red.mark_ready(1, odd.data());
      red.mark_ready(0, w.data());
      red.finalize();
      for (size_t i = 0; i < 3; ++i)
        for (size_t j = 0; j < 100; ++j)
          ASSERT_NEAR(w[i * 100 + j], 1.5 * (1.0 + i) * std::sin(0.1 * j), 1e-4) << "step " << step;
      for (size_t i = 0; i < odd.size(); ++i) ASSERT_NEAR(odd[i], 1.0 + std::cos(0.01 * i), 1e-5) << "step " << step;
    }
  });
}

// A bucket with no elements (here the f64 bucket of a zero-size parameter,
// last in the plan) is not handed to the hook: the last bucket the hook sees
// still ends the iteration, so PowerSGD counts iterations and starts
// compressing at start_iter.
TEST(PowerSgd, AnEmptyLastBucketStillEndsTheIteration) {
  run_ranks(2, "shm", [&](ProcessGroup& pg) {
    std::vector<float> w(40 * 30);
    double none = 0;
    auto state = std::make_shared<PowerSgdState>(PowerSgdOptions{.rank = 1, .start_iter = 2});
    ReducerOptions o;
    o.comm_hook = powersgd_hook(state);
    Reducer red(pg, {{"empty", 0, DType::F64, &none, 1}, {"w", w.size(), DType::F32, w.data(), 40}}, o);
    ASSERT_EQ(red.plan().size(), 2u);
    ASSERT_EQ(red.plan().back().count, 0u) << "the zero-size parameter's bucket comes last";
    for (int step = 0; step < 4; ++step) {
      for (size_t i = 0; i < w.size(); ++i) w[i] = float(pg.rank() + std::cos(0.01 * i));
      red.mark_ready(1, w.data());
      red.mark_ready(0, &none);
      red.finalize();
    }
    EXPECT_EQ(state->iteration(), 4);
  });
}

// A run stopped after step 3 (compressing since step 2) and resumed from
// state() in a fresh reducer gives the uninterrupted run's averages to the
// bit: the iteration, the warm-start Q and the error feedback come back.
// Without them (a fresh state) the resumed run restarts plain averaging.
TEST(PowerSgd, StateSavedMidRunResumesExactly) {
  const size_t rows = 24, cols = 20;
  auto gradient = [&](int rank, int step, std::vector<float>& w) {
    for (size_t i = 0; i < w.size(); ++i) w[i] = float(std::sin(0.037 * double(i) * (step + 1) + rank) + 0.1 * rank);
  };
  // Steps [from, 6) on a reducer over `state`; every step's averaged gradient.
  auto steps = [&](ProcessGroup& pg, const std::shared_ptr<PowerSgdState>& state, int from) {
    std::vector<float> w(rows * cols);
    ReducerOptions o;
    o.comm_hook = powersgd_hook(state);
    Reducer red(pg, {{"w", w.size(), DType::F32, w.data(), rows}}, o);
    std::vector<std::vector<float>> out;
    for (int step = from; step < 6; ++step) {
      gradient(pg.rank(), step, w);
      red.mark_ready(0, w.data());
      red.finalize();
      out.push_back(w);
      if (step == 2 && from == 0) break;  // the first half stops here
    }
    return out;
  };
  const PowerSgdOptions opts{.rank = 2, .start_iter = 2};
  run_ranks(2, "shm", [&](ProcessGroup& pg) {
    auto whole = std::make_shared<PowerSgdState>(opts);
    std::vector<std::vector<float>> want = steps(pg, whole, 0);  // steps 0-2
    const std::vector<NamedTensor> saved = whole->state();
    auto rest = steps(pg, whole, 3);                              // steps 3-5, uninterrupted
    want.insert(want.end(), rest.begin(), rest.end());

    auto resumed = std::make_shared<PowerSgdState>(opts);
    resumed->load_state(saved);
    EXPECT_EQ(resumed->iteration(), 3);
    const auto got = steps(pg, resumed, 3);
    ASSERT_EQ(got.size(), 3u);
    for (size_t s = 0; s < 3; ++s) EXPECT_EQ(got[s], want[3 + s]) << "step " << 3 + s;

    // Only the Qs and the iteration (another world size): the same steps, without the error feedback.
    auto no_error = std::make_shared<PowerSgdState>(opts);
    no_error->load_state(saved, /*with_error=*/false);
    EXPECT_NE(steps(pg, no_error, 3).front(), want[3]);

    std::vector<NamedTensor> bad = saved;
    bad.back().bytes.resize(3);
    EXPECT_THROW(resumed->load_state(bad), InvalidArgument);
    EXPECT_THROW(resumed->load_state({saved.begin() + 1, saved.end()}), InvalidArgument);  // no iteration
    for (const char* name : {"powersgd.bucket-1.q", "powersgd.bucket01.q", "powersgd.bucket0.p", "powersgd.x"}) {
      std::vector<NamedTensor> renamed = saved;
      renamed.back().name = name;
      EXPECT_THROW(resumed->load_state(renamed), InvalidArgument) << name;
    }
    std::vector<NamedTensor> twice = saved;
    twice.push_back(saved.back());
    EXPECT_THROW(resumed->load_state(twice), InvalidArgument);
    EXPECT_EQ(resumed->iteration(), 6) << "a refused load changes nothing";
  });
}

TEST(PowerSgd, BadOptionsAndBucketsAreRefusedByName) {
  EXPECT_THROW(PowerSgdState(PowerSgdOptions{.rank = 0}), InvalidArgument);
  try {
    PowerSgdState s(PowerSgdOptions{.rank = 2, .start_iter = 1});
    FAIL() << "start_iter 1 with error feedback was taken";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("run at least 2 plain iterations first"), std::string::npos) << e.what();
  }
  EXPECT_THROW(powersgd_hook(nullptr), InvalidArgument);
  run_ranks(2, "shm", [&](ProcessGroup& pg) {
    std::vector<double> w(64, 1.0);
    ReducerOptions o;
    o.comm_hook = powersgd_hook(std::make_shared<PowerSgdState>(PowerSgdOptions{.start_iter = 2}));
    Reducer red(pg, {{"w", w.size(), DType::F64, w.data(), 8}}, o);
    std::string m = test::error_of([&] { red.mark_ready(0, w.data()); });
    EXPECT_NE(m.find("powersgd_hook: bucket 0 holds f64 gradients; it compresses f32 buckets"), std::string::npos) << m;
  });
}

}  // namespace
}  // namespace cohort::ddp
