// Settings that choose the algorithms must be the same on every rank
// (group/job_settings.hpp): the pure check, and a job whose rank 1 differs.
#include <gtest/gtest.h>

#include "group/job_settings.hpp"
#include "launch_harness.hpp"
#include "scoped_env.hpp"

using cohort::group::job_wide_settings;
using cohort::group::settings_disagreement;
using cohort::testing::ScopedEnv;
namespace lt = launch_test;

namespace {
bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }
}  // namespace

TEST(JobSettings, SameSettingsAgree) {
  ScopedEnv a("COHORT_SINGLE_COPY_SHARED_BYTES", nullptr);
  const std::string s = job_wide_settings("");
  EXPECT_TRUE(contains(s, "COHORT_SINGLE_COPY_SHARED_BYTES=262144\n")) << s;
  EXPECT_TRUE(contains(s, "transport=\n")) << s;
  EXPECT_EQ(settings_disagreement({s, s, s}), "");
  EXPECT_EQ(settings_disagreement({}), "");
}

TEST(JobSettings, SizesCompareByValueNotSpelling) {
  std::string a, b;
  {
    ScopedEnv e("COHORT_SINGLE_COPY_BYTES", "1M");
    a = job_wide_settings("");
  }
  {
    ScopedEnv e("COHORT_SINGLE_COPY_BYTES", "1048576");
    b = job_wide_settings("");
  }
  EXPECT_EQ(settings_disagreement({a, b}), "");
}

TEST(JobSettings, ADifferentRankIsNamedWithBothValues) {
  std::string base, other, tcp;
  {
    ScopedEnv e("COHORT_SINGLE_COPY_SHARED_BYTES", nullptr);
    base = job_wide_settings("");
    tcp = job_wide_settings("tcp");
  }
  {
    ScopedEnv e("COHORT_SINGLE_COPY_SHARED_BYTES", "1M");
    other = job_wide_settings("");
  }
  const std::string why = settings_disagreement({base, base, other, base});
  EXPECT_TRUE(contains(why, "COHORT_SINGLE_COPY_SHARED_BYTES is 1048576 on rank 2 but 262144 on rank 0")) << why;
  EXPECT_TRUE(contains(why, "set them once in the launcher's environment")) << why;
  const std::string t = settings_disagreement({base, tcp});
  EXPECT_TRUE(contains(t, "COHORT_TRANSPORT is tcp on rank 1 but unset on rank 0")) << t;
}

// End to end: rank 1 alone sets a threshold. Every rank refuses at init,
// naming it, instead of waiting in a collective until the timeout.
TEST(JobSettings, AJobWhoseRanksDisagreeFailsAtOnceNamingTheKnob) {
  const std::string worker = lt::prog("coll_worker");
  auto r = lt::run({"run", "--standalone", "--nproc-per-node", "2", "/bin/sh", "-c",
                    "if [ \"$RANK\" = 1 ]; then export COHORT_SINGLE_COPY_SHARED_BYTES=1M; fi; exec " + worker +
                        " allreduce-loop 1048576 3"},
                   {{"COHORT_SINGLE_COPY_SHARED_BYTES", ""}, {"COHORT_TIMEOUT", "60s"}}, 60);
  EXPECT_NE(r.status, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "COHORT_SINGLE_COPY_SHARED_BYTES is 1048576 on rank 1 but 262144 on rank 0")) << r.err;
  EXPECT_LT(r.seconds, 30) << "the refusal comes at init, not after a timeout";
}
