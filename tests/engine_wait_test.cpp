// How long a waiting rank spins before it yields (transport::spin_us_for).
#include <gtest/gtest.h>

#include "scoped_env.hpp"
#include "transport/engine.hpp"

using cohort::testing::ScopedEnv;
using cohort::transport::spin_us_for;

TEST(EngineWait, SpinsUnlessTheHostsRanksOutnumberItsCpus) {
  ScopedEnv spin("COHORT_SPIN_US", nullptr);
  EXPECT_EQ(spin_us_for(2, 2), 30) << "a core per rank: spin";
  EXPECT_EQ(spin_us_for(2, 16), 30);
  EXPECT_EQ(spin_us_for(3, 2), 0) << "more ranks than CPUs: yield at once";
  EXPECT_EQ(spin_us_for(8, 2), 0);
  EXPECT_EQ(spin_us_for(0, 2), 30) << "ranks on the host unknown: spin";
  EXPECT_EQ(spin_us_for(8, 0), 30) << "CPUs unknown: spin";
}

TEST(EngineWait, TheUsersSpinWins) {
  ScopedEnv spin("COHORT_SPIN_US", "50");
  EXPECT_EQ(spin_us_for(8, 2), 50);
  EXPECT_EQ(spin_us_for(2, 2), 50);
  ScopedEnv zero("COHORT_SPIN_US", "0");
  EXPECT_EQ(spin_us_for(2, 16), 0);
}
