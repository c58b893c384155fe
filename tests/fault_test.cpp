// A rank that dies in the middle of a collective: every other rank fails fast
// (far below COHORT_TIMEOUT) with a message naming the dead rank.
#include <gtest/gtest.h>

#include "proc_util.hpp"

namespace cohort {
namespace {

using testing::Proc;

struct KillCase {
  std::string transport;
  int world;
};

void PrintTo(const KillCase& c, std::ostream* os) { *os << c.transport << " x " << c.world << " ranks"; }

class KillMid : public ::testing::TestWithParam<KillCase> {};

TEST_P(KillMid, OthersFailFastNamingTheDeadRank) {
  auto [transport, n] = GetParam();
  const int port = testing::free_port();
  ASSERT_GT(port, 0);
  const std::string prog = std::string(COHORT_TEST_BIN_DIR) + "/coll_worker";
  std::vector<Proc> ps;
  for (int r = 0; r < n; ++r) {
    std::map<std::string, std::string> env{{"RANK", std::to_string(r)},          {"WORLD_SIZE", std::to_string(n)},
                                           {"MASTER_ADDR", "127.0.0.1"},         {"MASTER_PORT", std::to_string(port)},
                                           {"COHORT_TRANSPORT", transport},      {"COHORT_TIMEOUT", "120s"},
                                           {"COHORT_RUN_ID", "killmid" + std::to_string(port)}};
    ps.push_back(testing::spawn({prog, "kill-mid", "1", std::to_string(32 << 20), "20"}, env,
                                ::testing::TempDir() + "/killmid_" + transport + std::to_string(n) + "_" + std::to_string(r)));
  }
  ASSERT_TRUE(testing::wait_all(ps, std::chrono::seconds(60))) << "a rank hung after its peer died";
  EXPECT_EQ(ps[1].term_signal(), SIGKILL) << ps[1].err();
  for (int r = 0; r < n; ++r) {
    if (r == 1) continue;
    std::string err = ps[r].err();
    EXPECT_EQ(ps[r].exit_code(), 3) << "rank " << r << ": " << err;
    EXPECT_NE(err.find("ERROR:"), std::string::npos) << err;
    EXPECT_NE(err.find("rank 1"), std::string::npos) << "rank " << r << " does not name the dead rank: " << err;
    EXPECT_NE(err.find("allreduce #"), std::string::npos) << err;
    // Detection is bounded by the liveness checks, not by the 120 s timeout: the
    // issue's promise is within 10 s of the death (measured: 0.02-0.11 s).
    EXPECT_LT(ps[r].exit_time_s - ps[1].exit_time_s, 10.0) << err;
  }
}

INSTANTIATE_TEST_SUITE_P(All, KillMid,
                         ::testing::Values(KillCase{"shm", 2}, KillCase{"tcp", 2}, KillCase{"shm", 3}, KillCase{"tcp", 3},
                                           KillCase{"shm", 4}),
                         [](const ::testing::TestParamInfo<KillCase>& i) {
                           return i.param.transport + "_np" + std::to_string(i.param.world);
                         });

}  // namespace
}  // namespace cohort
