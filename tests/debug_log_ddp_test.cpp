// COHORT_DEBUG=INFO with the DDP subsystem: building a Reducer logs its bucket
// plan. Its own binary, because the log level is read once per process: the
// static below sets it before anything logs.
#include <gtest/gtest.h>

#include <cstdlib>

#include "cohort/cohort.hpp"
#include "cohort/ddp.hpp"
#include "ddp_test_util.hpp"

namespace {

const bool kInfo = [] {
  setenv("COHORT_DEBUG", "INFO", 1);
  setenv("COHORT_DEBUG_SUBSYS", "DDP", 1);
  return true;
}();

}  // namespace

TEST(DebugLogDdp, ReducerLogsItsBucketPlanAtInfo) {
  ASSERT_TRUE(kInfo);
  cohort::InitOptions io;
  io.rank = 0;
  io.world_size = 1;
  io.store = std::make_shared<cohort::MemoryStore>();
  auto pg = cohort::init_process_group(io);
  testing::internal::CaptureStderr();
  {
    cohort::ddp::test::Grads g(cohort::ddp::test::mixed_model());
    cohort::ddp::Reducer reducer(*pg, g.specs, cohort::ddp::test::small_buckets());
  }
  std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("INFO DDP: bucket plan: 10 parameter(s)"), std::string::npos) << err;
  EXPECT_NE(err.find("in 6 bucket(s)"), std::string::npos) << err;
  // Bucket 0 is the last parameters (backward order): head.b then head.w.
  EXPECT_NE(err.find("INFO DDP: bucket 0: 2 parameter(s), f32 x 121"), std::string::npos) << err;
  EXPECT_NE(err.find("first head.b, last head.w"), std::string::npos) << err;
  EXPECT_EQ(err.find("INFO INIT"), std::string::npos) << "COHORT_DEBUG_SUBSYS=DDP must leave INIT out:\n" << err;
  pg->shutdown();
}
