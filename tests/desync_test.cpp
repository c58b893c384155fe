// Ranks that call different collectives at the same sequence number: a
// different op, dtype, count or root, or a skipped call. Each is reported as a
// desync naming both calls (never silently wrong data, never a hang), on shm
// and on tcp. Ranks run as threads over a MemoryStore.
#include <gtest/gtest.h>

#include "test_util.hpp"

namespace cohort {
namespace {

struct Outcome {
  std::vector<std::string> errs = std::vector<std::string>(2);
  std::string all() const { return errs[0] + "\n" + errs[1]; }
};

// fn(pg) issues rank-dependent calls; records each rank's error.
Outcome run2(const std::string& transport, const std::function<void(ProcessGroup&)>& fn) {
  Outcome o;
  testing::run_ranks(2, transport, [&](ProcessGroup& pg) {
    try {
      fn(pg);
    } catch (const Error& e) {
      o.errs[pg.rank()] = e.what();
    }
  });
  return o;
}

const AllreduceOptions kSum{.op = ReduceOp::Sum, .timeout = Millis(10000)};

class Desync : public ::testing::TestWithParam<std::string> {};

TEST_P(Desync, DifferentReduceOp) {
  auto o = run2(GetParam(), [](ProcessGroup& pg) {
    std::vector<float> v(64, 1.0f);
    pg.allreduce(buffer(v), {.op = pg.rank() == 0 ? ReduceOp::Sum : ReduceOp::Max, .timeout = Millis(10000)})->wait();
  });
  EXPECT_NE(o.all().find("desync: rank"), std::string::npos) << o.all();
  EXPECT_NE(o.all().find("allreduce #0 (f32 x 64, sum)"), std::string::npos) << o.all();
  EXPECT_NE(o.all().find("allreduce #0 (f32 x 64, max)"), std::string::npos) << o.all();
}

TEST_P(Desync, DifferentDtype) {
  auto o = run2(GetParam(), [](ProcessGroup& pg) {
    std::vector<float> f(64, 1.0f);
    std::vector<int32_t> i(64, 1);
    if (pg.rank() == 0)
      pg.allreduce(buffer(f), kSum)->wait();
    else
      pg.allreduce(buffer(i), kSum)->wait();
  });
  EXPECT_NE(o.all().find("desync: rank"), std::string::npos) << o.all();
  EXPECT_NE(o.all().find("allreduce #0 (f32 x 64, sum)"), std::string::npos) << o.all();
  EXPECT_NE(o.all().find("allreduce #0 (i32 x 64, sum)"), std::string::npos) << o.all();
}

TEST_P(Desync, DifferentCount) {
  auto o = run2(GetParam(), [](ProcessGroup& pg) {
    std::vector<float> v(pg.rank() == 0 ? 64 : 96, 1.0f);
    pg.allreduce(buffer(v), kSum)->wait();
  });
  EXPECT_NE(o.all().find("desync: rank"), std::string::npos) << o.all();
  EXPECT_NE(o.all().find("allreduce #0 (f32 x 64, sum)"), std::string::npos) << o.all();
  EXPECT_NE(o.all().find("allreduce #0 (f32 x 96, sum)"), std::string::npos) << o.all();
}

TEST_P(Desync, DifferentRoot) {
  auto o = run2(GetParam(), [](ProcessGroup& pg) {
    std::vector<float> v(64, 1.0f);
    // Each rank is the root of its own reduce: both only receive, no message
    // reveals the mismatch, and the timeout's verdict compares the calls.
    pg.reduce(buffer(v), buffer(v), {.op = ReduceOp::Sum, .root = pg.rank(), .timeout = Millis(2000)})->wait();
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(o.errs[r].find("desync at #0 of group 0: rank 0 called reduce #0 (f32 x 64, sum, root 0), rank 1 called "
                             "reduce #0 (f32 x 64, sum, root 1)"),
              std::string::npos)
        << o.all();
}

TEST_P(Desync, SkippedCall) {
  // Rank 1 skips the first allreduce: its second call meets rank 0's first.
  auto o = run2(GetParam(), [](ProcessGroup& pg) {
    std::vector<float> small(64, 1.0f), large(256, 1.0f);
    if (pg.rank() == 0) pg.allreduce(buffer(small), kSum)->wait();
    pg.allreduce(buffer(large), kSum)->wait();
  });
  EXPECT_NE(o.errs[0].find("desync: rank 1 is in allreduce #0 (f32 x 256, sum) while this rank is in allreduce #0 "
                           "(f32 x 64, sum)"),
            std::string::npos)
      << o.all();
}

TEST_P(Desync, MatchingCallsStillWork) {
  auto o = run2(GetParam(), [](ProcessGroup& pg) {
    std::vector<float> v(64, 1.0f);
    pg.allreduce(buffer(v), kSum)->wait();
    EXPECT_EQ(v[63], 2.0f);
  });
  EXPECT_EQ(o.all(), "\n");
}

INSTANTIATE_TEST_SUITE_P(Transports, Desync, ::testing::Values("shm", "tcp"));

}  // namespace
}  // namespace cohort
