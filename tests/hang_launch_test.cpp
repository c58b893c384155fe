// A rank that sleeps before a collective: the others time out, and
// `cohort run` prints one hang verdict naming the late rank, the operation and
// its sequence number, and the late rank's last completed operation.
#include <gtest/gtest.h>

#include <regex>

#include "launch_harness.hpp"

namespace cohort {
namespace {

using launch_test::prog;

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

class HangLaunch : public ::testing::TestWithParam<std::string> {};

TEST_P(HangLaunch, VerdictNamesTheLateRankOnce) {
  const std::string transport = GetParam();
  // 6 allreduces (#0 .. #5); rank 1 sleeps 30 s before #5, the others time out after 3 s in it.
  auto r = launch_test::run(
      {"run", "--standalone", "--nproc-per-node", "3", "--no-python", prog("hang_worker"), "hang", "1", "30", "6",
       "1024"},
      {{"COHORT_TIMEOUT", "3s"}, {"COHORT_TRANSPORT", transport}, {"COHORT_FLIGHT_RECORDER_HEARTBEAT", "200ms"}}, 90);
  const std::string all = r.out + r.err;
  EXPECT_NE(r.status, 0) << all;
  EXPECT_EQ(count_of(r.err, "cohort run: hang verdict:"), 1u) << all;
  EXPECT_NE(r.err.find("cohort run: hang verdict: rank 1 never entered allreduce #5 (group 0, 1024 elements, f32)"),
            std::string::npos)
      << all;
  EXPECT_NE(r.err.find("ranks 0,2 have waited"), std::string::npos) << all;
  EXPECT_NE(r.err.find("rank 1's last completed operation was allreduce #4 (f32 x 1024, sum)"), std::string::npos)
      << all;
  // A rank that timed out carries the same verdict in its own error.
  EXPECT_NE(r.err.find("[4096 bytes] failed: hang verdict: rank 1 never entered allreduce #5"), std::string::npos)
      << all;
}

// A rank that freezes in the middle of busy work (SIGSTOP between two of a
// thousand back-to-back allreduces, each queued to its progress thread): the
// verdict names its last completed operation, not "none", because a busy rank
// publishes its progress too, and says how old that record is.
TEST_P(HangLaunch, ABusyRankThatFreezesHasPublishedItsProgress) {
  auto r = launch_test::run({"run", "--standalone", "--nproc-per-node", "2", "--no-python", prog("hang_worker"),
                             "stop", "1", "1000", "262144"},
                            {{"COHORT_TIMEOUT", "3s"},
                             {"COHORT_TRANSPORT", GetParam()},
                             // Far shorter than the busy work: over shm the 999 allreduces of
                             // 1 MiB can take under 100 ms, and a rank that froze before its
                             // first publication read as "none" (a flake under no load).
                             {"COHORT_FLIGHT_RECORDER_HEARTBEAT", "10ms"},
                             {"COHORT_TERM_TIMEOUT", "1s"}},
                            90);
  const std::string all = r.out + r.err;
  EXPECT_NE(r.status, 0) << all;
  EXPECT_NE(r.err.find("cohort run: hang verdict: rank 1 never entered allreduce #999 (group 0, 262144 elements, f32)"),
            std::string::npos)
      << all;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.err, m,
                                std::regex("rank 1's last completed operation was allreduce #([0-9]+) \\(f32 x 262144, "
                                           "sum\\) \\(as published ([0-9.]+) s ago\\)")))
      << all;
  EXPECT_GT(std::stoi(m[1].str()), 0) << "a busy rank's progress reached the store: " << m[0];
  EXPECT_LT(std::stod(m[2].str()), 60.0) << m[0];
}

// Processes under `cohort run`: rank 1 passes a different count; every rank
// fails at once (no timeout) with both calls named, and no hang verdict.
TEST_P(HangLaunch, DesyncBetweenProcessesNamesBothCalls) {
  auto r = launch_test::run(
      {"run", "--standalone", "--nproc-per-node", "2", "--no-python", prog("hang_worker"), "desync", "1024"},
      {{"COHORT_TIMEOUT", "60s"}, {"COHORT_TRANSPORT", GetParam()}}, 90);
  const std::string all = r.out + r.err;
  EXPECT_NE(r.status, 0) << all;
  EXPECT_NE(all.find("desync: rank 1 is in allreduce #0 (f32 x 2048, sum) while this rank is in allreduce #0 (f32 x "
                     "1024, sum)"),
            std::string::npos)
      << all;
  EXPECT_EQ(all.find("hang verdict"), std::string::npos) << all;
}

INSTANTIATE_TEST_SUITE_P(Transports, HangLaunch, ::testing::Values("shm", "tcp"));

}  // namespace
}  // namespace cohort
