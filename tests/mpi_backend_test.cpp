// The mpi backend under mpirun: the collective suite (tests/mpi/mpi_coll_worker.cpp,
// the checks of tests/collective_checks.hpp) for 1..4 ranks, `cohort bench -c 1`
// of every collective, and the watchdog of a call no peer joins.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "mpi/mpirun_args.hpp"
#include "proc_util.hpp"

namespace cohort {
namespace {

using testing::Proc;

#ifdef COHORT_MPI_WORKER
constexpr bool kBuilt = true;
#else
constexpr bool kBuilt = false;
#define COHORT_MPI_WORKER ""
#define COHORT_MPIEXEC ""
#endif

std::vector<std::string> mpirun(int np) { return testing::mpirun_args(COHORT_MPIEXEC, np); }

struct MpiRun {
  int code;
  std::string out, err;
};

MpiRun run(std::vector<std::string> argv, std::map<std::string, std::string> env, const std::string& name,
           int limit_s = 300) {
  std::vector<Proc> ps{testing::spawn(argv, env, std::string(COHORT_TEST_BIN_DIR) + "/" + name)};
  EXPECT_TRUE(testing::wait_all(ps, std::chrono::seconds(limit_s))) << name << " was killed after " << limit_s << " s";
  return {ps[0].exit_code(), ps[0].out(), ps[0].err()};
}

// np x COHORT_MPI_BLOCKING_BYTES x COHORT_MPI_ASYNC: the default (64K: small
// counts blocking on the caller, large ones on the progress thread), 0 (every
// collective on the progress thread) and 1G (every one on the caller's
// thread); async "nonblocking": large ones as MPI's nonblocking calls.
struct SuiteParam {
  int np;
  std::string blocking_bytes;
  std::string async = "";
};

void PrintTo(const SuiteParam& p, std::ostream* os) {
  *os << p.np << " ranks, COHORT_MPI_BLOCKING_BYTES=" << (p.blocking_bytes.empty() ? "64K" : p.blocking_bytes)
      << ", COHORT_MPI_ASYNC=" << (p.async.empty() ? "thread" : p.async);
}

class MpiSuite : public ::testing::TestWithParam<SuiteParam> {};

TEST_P(MpiSuite, CollectiveChecksPass) {
  if (!kBuilt) GTEST_SKIP() << "this build has no MPI backend";
  const auto& [np, blocking, async] = GetParam();
  auto argv = mpirun(np);
  argv.push_back(COHORT_MPI_WORKER);
  std::map<std::string, std::string> env{{"COHORT_TIMEOUT", "120s"}};
  if (!blocking.empty()) env["COHORT_MPI_BLOCKING_BYTES"] = blocking;
  if (!async.empty()) env["COHORT_MPI_ASYNC"] = async;
  MpiRun r = run(argv, env, "mpi_suite_np" + std::to_string(np) + "_" + blocking + "_" + async);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("[  PASSED  ]"), std::string::npos) << r.out << r.err;
  EXPECT_EQ(r.out.find("[  FAILED  ]"), std::string::npos) << r.out << r.err;
}

INSTANTIATE_TEST_SUITE_P(Np, MpiSuite,
                         ::testing::Values(SuiteParam{1, ""}, SuiteParam{2, ""}, SuiteParam{3, ""}, SuiteParam{4, ""},
                                           SuiteParam{3, "0"}, SuiteParam{2, "1G"}, SuiteParam{2, "", "nonblocking"},
                                           SuiteParam{3, "0", "nonblocking"}),
                         [](const ::testing::TestParamInfo<SuiteParam>& i) {
                           return "np" + std::to_string(i.param.np) +
                                  (i.param.blocking_bytes.empty() ? "" : "_blocking_bytes_" + i.param.blocking_bytes) +
                                  (i.param.async.empty() ? "" : "_async_" + i.param.async);
                         });

// A thread level MPI does not know is refused before MPI starts, naming the knob.
TEST(MpiBackend, BadThreadLevelIsNamed) {
  if (!kBuilt) GTEST_SKIP() << "this build has no MPI backend";
  auto argv = mpirun(1);
  argv.push_back(COHORT_MPI_WORKER);
  MpiRun r = run(argv, {{"COHORT_MPI_THREAD_LEVEL", "sometimes"}}, "mpi_bad_thread_level", 120);
  EXPECT_EQ(r.code, 3) << r.out << r.err;
  EXPECT_NE(r.err.find("COHORT_MPI_THREAD_LEVEL=sometimes: unknown thread level"), std::string::npos) << r.err;
}

// `cohort bench -c 1` of every collective on the mpi backend: zero wrong values.
TEST(MpiBackend, BenchEveryCollectiveChecks) {
  if (!kBuilt) GTEST_SKIP() << "this build has no MPI backend";
  for (std::string coll : {"allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall", "gather",
                           "scatter", "sendrecv"}) {
    auto argv = mpirun(3);
    for (std::string a : {std::string(COHORT_BIN), std::string("bench"), coll, std::string("-b"), std::string("8"),
                          std::string("-e"), std::string("1M"), std::string("-f"), std::string("32"), std::string("-n"),
                          std::string("3"), std::string("-w"), std::string("1"), std::string("-c"), std::string("1")})
      argv.push_back(a);
    MpiRun r = run(argv, {{"COHORT_BACKEND", "mpi"}, {"COHORT_TIMEOUT", "120s"}}, "mpi_bench_" + coll);
    EXPECT_EQ(r.code, 0) << coll << "\n" << r.out << r.err;
    EXPECT_NE(r.out.find("backend: mpi"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("# Out of bounds values : 0 OK"), std::string::npos) << coll << "\n" << r.out << r.err;
  }
}

// A blocking call that no peer joins: MPI cannot cancel it, so the watchdog
// ends the process after COHORT_TIMEOUT with a message naming the call.
TEST(MpiBackend, WatchdogEndsAHungCall) {
  if (!kBuilt) GTEST_SKIP() << "this build has no MPI backend";
  auto argv = mpirun(2);
  argv.push_back(COHORT_MPI_WORKER);
  argv.push_back("hang");
  MpiRun r = run(argv, {{"COHORT_TIMEOUT", "1s"}}, "mpi_hang", 120);
  EXPECT_NE(r.code, 0) << r.out << r.err;
  EXPECT_EQ(r.out.find("allreduce returned"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("rank 0: allreduce #"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("still in MPI_Allreduce"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("COHORT_TIMEOUT"), std::string::npos) << r.err;
}

// Started by `cohort run` instead of mpirun, every process would be a world of
// its own: init_process_group refuses, saying how to start it.
TEST(MpiBackend, StartedByCohortRunIsRefused) {
  if (!kBuilt) GTEST_SKIP() << "this build has no MPI backend";
  // --standalone: a free store port, so that a test running beside it cannot take it.
  MpiRun r = run({COHORT_BIN, "run", "--standalone", "--nproc-per-node", "2", COHORT_BIN, "bench", "allreduce",
                  "--sizes", "8"},
                 {{"COHORT_BACKEND", "mpi"}}, "mpi_under_cohort_run", 120);
  EXPECT_NE(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("needs its processes started by mpirun"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace cohort
