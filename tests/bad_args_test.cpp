// Bad arguments raise InvalidArgument naming what was wrong; the group stays usable.
#include <gtest/gtest.h>

#include "test_util.hpp"

namespace cohort {
namespace {

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(no InvalidArgument thrown)";
}

#define EXPECT_MSG(call, needle)                                         \
  do {                                                                   \
    std::string m_ = error_of([&] { call; });                            \
    EXPECT_NE(m_.find(needle), std::string::npos) << "message: " << m_; \
  } while (0)

TEST(BadArgs, EveryCheckNamesTheProblem) {
  testing::run_ranks(2, "shm", [](ProcessGroup& pg) {
    std::vector<float> a(10), b(7), c(20);
    std::vector<int32_t> ints(10);
    EXPECT_MSG(pg.allreduce(buffer(a), buffer(b)), "send has 10 elements but recv has 7");
    EXPECT_MSG(pg.allreduce(buffer(a), buffer(ints)), "send is f32 but recv is i32");
    EXPECT_MSG(pg.allreduce(Buffer{a.data() + 1, 5, DType::F32}, Buffer{a.data(), 5, DType::F32}), "overlap");
    EXPECT_MSG(pg.allreduce(Buffer{nullptr, 4, DType::F32}), "null");
    EXPECT_MSG(pg.allreduce(Buffer{a.data(), 1, static_cast<DType>(99)}), "unknown dtype");
    EXPECT_MSG(pg.allreduce(buffer(a), {.op = static_cast<ReduceOp>(17)}), "unknown reduce op");
    EXPECT_MSG(pg.broadcast(buffer(a), {.root = 2}), "root 2 is out of range");
    EXPECT_MSG(pg.reduce(buffer(a), buffer(a), {.root = -1}), "root -1 is out of range");
    EXPECT_MSG(pg.allgather(buffer(a), buffer(b)), "must have group size x send count = 2 x 10 = 20");
    EXPECT_MSG(pg.reduce_scatter(buffer(a), buffer(b)), "send has 10 elements but must have");
    EXPECT_MSG(pg.alltoall(buffer(b), buffer(b)), "divisible by the group size 2");
    EXPECT_MSG(pg.send(buffer(a), pg.rank()), "cannot send to or receive from itself");
    EXPECT_MSG(pg.send(buffer(a), 5), "peer rank 5 is out of range");
    EXPECT_MSG(pg.recv(buffer(a), 1 - pg.rank(), {.tag = -2}), "tag -2 is negative");
    EXPECT_MSG(pg.new_group({0, 3}), "rank 3 is out of range");
    EXPECT_MSG(pg.new_group({1, 1}), "listed twice");
    // Still usable after all of that.
    std::fill(a.begin(), a.end(), 1.0f);
    pg.allreduce(buffer(a))->wait();
    EXPECT_EQ(a[3], 2.0f);
    // Allgather with correct sizes works.
    pg.allgather(buffer(a), buffer(c))->wait();
  });
}

TEST(BadArgs, MismatchedCountsAcrossRanksFailWithBothSizes) {
  // Rank 0 passes 100 elements, rank 1 passes 200: the receiver sees a message
  // of the wrong size and says so, instead of corrupting memory or hanging.
  std::vector<std::string> errs(2);
  testing::run_ranks(2, "shm", [&](ProcessGroup& pg) {
    std::vector<float> v(pg.rank() == 0 ? 100 : 200, 1.0f);
    try {
      pg.allreduce(buffer(v), {.timeout = Millis(5000)})->wait();
    } catch (const Error& e) {
      errs[pg.rank()] = e.what();
    }
  });
  std::string both = errs[0] + "\n" + errs[1];
  EXPECT_NE(both.find("allreduce #0 (f32 x 100, sum)"), std::string::npos) << both;
  EXPECT_NE(both.find("allreduce #0 (f32 x 200, sum)"), std::string::npos) << both;
}

TEST(BadArgs, DifferentCollectivesAtTheSameStepAreReported) {
  std::vector<std::string> errs(2);
  testing::run_ranks(2, "tcp", [&](ProcessGroup& pg) {
    std::vector<float> v(64, 1.0f);
    try {
      if (pg.rank() == 0) pg.allreduce(buffer(v), {.timeout = Millis(3000)})->wait();
      else pg.broadcast(buffer(v), {.root = 1, .timeout = Millis(3000)})->wait();
    } catch (const Error& e) {
      errs[pg.rank()] = e.what();
    }
  });
  // Rank 0 (in allreduce) receives rank 1's broadcast message and names both calls.
  EXPECT_NE(errs[0].find("desync: rank 1 is in broadcast #0 (f32 x 64, root 1) while this rank is in allreduce #0 (f32 x 64, sum)"),
            std::string::npos)
      << errs[0];
}

TEST(BadArgs, SubgroupListsThatDifferBetweenRanksAreNamed) {
  testing::run_ranks(2, "shm", [](ProcessGroup& pg) {
    // Rank 0 passes {0, 1}, rank 1 {1, 0}: each would think itself the new rank 0.
    try {
      pg.new_group(pg.rank() == 0 ? std::vector<int>{0, 1} : std::vector<int>{1, 0});
      ADD_FAILURE() << "different lists were accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(pg.rank() == 0 ? "passed [0,1] but rank 1 passed [1,0]"
                                                          : "passed [1,0] but rank 0 passed [0,1]"),
                std::string::npos)
          << e.what();
    }
  });
}

TEST(BadArgs, SubgroupsWorkAndNonMembersGetNull) {
  testing::run_ranks(4, "shm", [](ProcessGroup& pg) {
    auto evens = pg.new_group({0, 2});
    auto odds = pg.new_group({3, 1});  // order gives the new ranks: world 3 is rank 0
    if (pg.rank() % 2 == 0) {
      ASSERT_TRUE(evens);
      EXPECT_FALSE(odds);
      EXPECT_EQ(evens->size(), 2);
      std::vector<int32_t> v(5, pg.rank());
      evens->allreduce(buffer(v))->wait();
      EXPECT_EQ(v[4], 2);
    } else {
      ASSERT_TRUE(odds);
      EXPECT_FALSE(evens);
      EXPECT_EQ(odds->rank(), pg.rank() == 3 ? 0 : 1);
      std::vector<int32_t> v(5, pg.rank());
      odds->broadcast(buffer(v), {.root = 0})->wait();
      EXPECT_EQ(v[0], 3);
    }
    pg.barrier()->wait();
  });
}

}  // namespace
}  // namespace cohort
