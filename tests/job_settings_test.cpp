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

// This process's settings with `name` set to `value` (nullptr: unset).
std::string settings_with(const char* name, const char* value, const std::string& transport = "") {
  ScopedEnv e(name, value);
  return job_wide_settings(transport);
}
}  // namespace

TEST(JobSettings, SameSettingsAgree) {
  ScopedEnv a("COHORT_SINGLE_COPY_SHARED_BYTES", nullptr);
  const std::string s = job_wide_settings("");
  EXPECT_TRUE(contains(s, "host:COHORT_SINGLE_COPY_SHARED_BYTES=262144\n")) << s;
  EXPECT_TRUE(contains(s, "job:COHORT_NSOCKS_PER_PEER=")) << s;
  EXPECT_TRUE(contains(s, "job:COHORT_ALGO=")) << s;
  EXPECT_TRUE(contains(s, "host:COHORT_TRANSPORT=\n")) << s;
  EXPECT_EQ(settings_disagreement({s, s, s}, {"h", "h", "h"}), "");
  EXPECT_EQ(settings_disagreement({}, {}), "");
}

TEST(JobSettings, SizesCompareByValueNotSpelling) {
  const std::string a = settings_with("COHORT_SINGLE_COPY_BYTES", "1M");
  const std::string b = settings_with("COHORT_SINGLE_COPY_BYTES", "1048576");
  EXPECT_EQ(settings_disagreement({a, b}, {"h", "h"}), "");
}

TEST(JobSettings, ADifferentRankIsNamedWithBothValues) {
  const std::string base = settings_with("COHORT_SINGLE_COPY_SHARED_BYTES", nullptr);
  const std::string tcp = settings_with("COHORT_SINGLE_COPY_SHARED_BYTES", nullptr, "tcp");
  const std::string other = settings_with("COHORT_SINGLE_COPY_SHARED_BYTES", "1M");
  const std::string why = settings_disagreement({base, base, other, base}, {"h", "h", "h", "h"});
  EXPECT_TRUE(contains(why, "COHORT_SINGLE_COPY_SHARED_BYTES is 1048576 on rank 2 but 262144 on rank 0 (the same host)"))
      << why;
  EXPECT_TRUE(contains(why, "set them once in the launcher's environment")) << why;
  const std::string t = settings_disagreement({base, tcp}, {"h", "h"});
  EXPECT_TRUE(contains(t, "COHORT_TRANSPORT is tcp on rank 1 but unset on rank 0 (the same host)")) << t;
}

// Single copy and the transport choose between the ranks of one host only:
// two hosts may differ, two ranks of one host may not.
TEST(JobSettings, HostKnobsMayDifferBetweenHosts) {
  const std::string base = settings_with("COHORT_SINGLE_COPY_SHARED_BYTES", nullptr);
  const std::string other = settings_with("COHORT_SINGLE_COPY_SHARED_BYTES", "1M");
  EXPECT_EQ(settings_disagreement({base, base, other, other}, {"a", "a", "b", "b"}), "");
  EXPECT_EQ(settings_disagreement({base, other}, {"a", "b"}), "");
  const std::string why = settings_disagreement({base, base, base, other}, {"a", "a", "b", "b"});
  EXPECT_TRUE(contains(why, "COHORT_SINGLE_COPY_SHARED_BYTES is 1048576 on rank 3 but 262144 on rank 2 (the same host)"))
      << why;
}

// The algorithm choice and the TCP striping must agree across hosts too.
TEST(JobSettings, JobKnobsMustAgreeAcrossHosts) {
  const std::string base = settings_with("COHORT_NSOCKS_PER_PEER", nullptr);
  const std::string one_socket = settings_with("COHORT_NSOCKS_PER_PEER", "1");
  const std::string why = settings_disagreement({base, one_socket}, {"a", "b"});
  EXPECT_TRUE(contains(why, "COHORT_NSOCKS_PER_PEER is 1 on rank 1 but 2 on rank 0:")) << why;
  EXPECT_TRUE(contains(why, "must be the same on every rank")) << why;
}

// End to end: rank 1 alone forces the ring for a 1000-byte allreduce that
// rank 0 runs by recursive doubling. Without the check the two would wait for
// each other's messages; every rank refuses at init instead, naming the knob.
TEST(JobSettings, AJobWhoseRanksDisagreeFailsAtOnceNamingTheKnob) {
  const std::string worker = lt::prog("coll_worker");
  auto r = lt::run({"run", "--standalone", "--nproc-per-node", "2", "/bin/sh", "-c",
                    "if [ \"$RANK\" = 1 ]; then export COHORT_ALGO=allreduce=ring; fi; exec " + worker +
                        " allreduce-loop 1000 3"},
                   {{"COHORT_ALGO", ""}, {"COHORT_TIMEOUT", "60s"}}, 90);
  EXPECT_NE(r.status, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "[rank0]: ERROR: group 0: COHORT_ALGO is allreduce=ring on rank 1 but unset on rank 0"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "[rank1]: ERROR: group 0: COHORT_ALGO is allreduce=ring on rank 1 but unset on rank 0"))
      << r.err;
  EXPECT_LT(r.seconds, 30) << "the refusal comes at init, not after a timeout";
}
