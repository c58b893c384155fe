// `cohort run` and the job secret: a random per-job secret shared by the
// launcher's store and every worker; a user-given COHORT_SECRET_FILE; an
// unreadable one refused with a message naming it.
#include <gtest/gtest.h>

#include <fstream>
#include <set>

#include "launch_harness.hpp"

namespace cohort {
namespace {

using launch_test::prog;

// The values of "COHORT_SECRET=..." lines (the launcher prefixes "[rankN]: ").
std::vector<std::string> secrets_in(const std::string& out) {
  std::vector<std::string> s;
  const std::string key = "COHORT_SECRET=";
  for (size_t at = out.find(key); at != std::string::npos; at = out.find(key, at + 1)) {
    size_t end = out.find('\n', at);
    s.push_back(out.substr(at + key.size(), end == std::string::npos ? std::string::npos : end - at - key.size()));
  }
  return s;
}

TEST(JobSecretLaunch, EachJobGetsItsOwnRandomSecret) {
  const std::map<std::string, std::string> env{
      {"COHORT_SECRET", ""}, {"COHORT_SECRET_FILE", ""}, {"COHORT_STORE_SECRET", ""}};
  auto a = launch_test::run({"run", "--standalone", "--nproc-per-node", "2", "--no-python", prog("launch_env")}, env);
  auto b = launch_test::run({"run", "--standalone", "--nproc-per-node", "2", "--no-python", prog("launch_env")}, env);
  ASSERT_EQ(a.status, 0) << a.err;
  ASSERT_EQ(b.status, 0) << b.err;
  auto sa = secrets_in(a.out), sb = secrets_in(b.out);
  ASSERT_EQ(sa.size(), 2u) << a.out;
  ASSERT_EQ(sb.size(), 2u) << b.out;
  EXPECT_EQ(sa[0], sa[1]) << "the workers of one job share it";
  EXPECT_EQ(sa[0].size(), 64u) << sa[0];
  EXPECT_NE(sa[0], sb[0]) << "two jobs must not share a secret";
}

TEST(JobSecretLaunch, WorkersAuthenticateToTheStoreAndEachOther) {
  auto r = launch_test::run({"run", "--standalone", "--nproc-per-node", "2", "--no-python", prog("coll_worker"),
                             "allreduce-loop", "65536", "3"},
                            {{"COHORT_SECRET", ""}, {"COHORT_TRANSPORT", "tcp"}, {"COHORT_TIMEOUT", "60s"}});
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("rank 1 ok"), std::string::npos) << r.out << r.err;
}

TEST(JobSecretLaunch, UserSecretFileIsUsedAndABadOneRefused) {
  const std::string dir = launch_test::temp_dir();
  const std::string path = dir + "/secret";
  std::ofstream(path) << "shared-by-every-node\n";
  auto r = launch_test::run({"run", "--standalone", "--nproc-per-node", "2", "--no-python", prog("coll_worker"),
                             "allreduce-loop", "4096", "2"},
                            {{"COHORT_SECRET", ""}, {"COHORT_SECRET_FILE", path}, {"COHORT_TRANSPORT", "tcp"}});
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  auto bad = launch_test::run({"run", "--standalone", "--nproc-per-node", "2", "--no-python", prog("launch_env")},
                              {{"COHORT_SECRET", ""}, {"COHORT_SECRET_FILE", dir + "/missing"}});
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.err.find("COHORT_SECRET_FILE=" + dir + "/missing cannot be read"), std::string::npos) << bad.err;
}

}  // namespace
}  // namespace cohort
