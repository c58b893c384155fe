// COHORT_DEBUG / COHORT_DEBUG_SUBSYS end to end: 2-rank jobs under `cohort run`
// (tests/progs/coll_worker.cpp) and what their stderr says at each level.
#include <gtest/gtest.h>

#include "launch_harness.hpp"

namespace lt = launch_test;

namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// One allreduce of the given size (default 1000 bytes: recursive doubling).
lt::Result job(std::map<std::string, std::string> env, std::vector<std::string> bytes = {"1000"}) {
  for (const char* k : {"COHORT_DEBUG", "COHORT_DEBUG_SUBSYS", "COHORT_TRANSPORT", "COHORT_ALGO", "COHORT_SINGLE_COPY_BYTES",
                        "COHORT_SINGLE_COPY_SHARED_BYTES", "COHORT_HOST_CPUS", "COHORT_SPIN_US"})
    env.emplace(k, "");  // unset unless the test sets it: the caller's shell must not change the output
  return lt::run({"run", "--standalone", "--nproc-per-node", "2", lt::prog("coll_worker"), "allreduce-loop",
                  bytes.at(0), "1"},
                 std::move(env), 120);
}

}  // namespace

TEST(DebugLog, InfoNamesTheTransportTheTopologyAndTheThresholds) {
  auto r = job({{"COHORT_DEBUG", "INFO"}});
  ASSERT_EQ(r.status, 0) << r.err;
  for (int rank : {0, 1}) {
    const std::string me = "[rank" + std::to_string(rank) + "]: cohort[rank " + std::to_string(rank) + "] INFO ";
    const int peer = 1 - rank;
    EXPECT_TRUE(contains(r.err, me + "INIT: group 0: peer " + std::to_string(peer) + " (world rank " +
                                    std::to_string(peer) + "): transport shm, same host"))
        << r.err;
    EXPECT_TRUE(contains(r.err, me + "INIT: host with 2 local rank(s): ")) << r.err;
    EXPECT_TRUE(contains(r.err, "CPU(s) online; this process may run on CPUs ")) << r.err;
    EXPECT_TRUE(contains(r.err, me + "TUNING: group 0: tuner thresholds for 2 ranks (all peers over shm): allreduce "
                                     "recursive_doubling up to 16 KiB, ring above"))
        << r.err;
    EXPECT_TRUE(contains(r.err, me + "INIT: rank " + std::to_string(rank) + " of 2 (local rank " +
                                    std::to_string(rank) + " of 2) from cohort run's variables (RANK=" +
                                    std::to_string(rank) + " WORLD_SIZE=2"))
        << r.err;
  }
  EXPECT_FALSE(contains(r.err, "TRACE")) << r.err;
}

// More ranks on the host than CPUs: a waiting rank yields at once instead of
// spinning on a core that the rank it waits for needs, and INFO says so.
TEST(DebugLog, RanksThatOutnumberTheCpusYieldInsteadOfSpinning) {
  const std::string line = "INFO INIT: group 0: 2 ranks on this host share 1 CPU(s): a waiting rank yields at once";
  auto one = job({{"COHORT_DEBUG", "INFO"}, {"COHORT_DEBUG_SUBSYS", "INIT"}, {"COHORT_HOST_CPUS", "1"}});
  ASSERT_EQ(one.status, 0) << one.err;
  EXPECT_TRUE(contains(one.err, "[rank0]: cohort[rank 0] " + line)) << one.err;
  EXPECT_TRUE(contains(one.err, "[rank1]: cohort[rank 1] " + line)) << one.err;

  auto two = job({{"COHORT_DEBUG", "INFO"}, {"COHORT_DEBUG_SUBSYS", "INIT"}, {"COHORT_HOST_CPUS", "2"}});
  ASSERT_EQ(two.status, 0) << two.err;
  EXPECT_FALSE(contains(two.err, "yields at once")) << two.err;

  auto spin = job({{"COHORT_DEBUG", "INFO"}, {"COHORT_DEBUG_SUBSYS", "INIT"}, {"COHORT_HOST_CPUS", "1"},
                   {"COHORT_SPIN_US", "30"}});
  ASSERT_EQ(spin.status, 0) << spin.err;
  EXPECT_FALSE(contains(spin.err, "yields at once")) << "the user's COHORT_SPIN_US wins:\n" << spin.err;

  auto bad = job({{"COHORT_HOST_CPUS", "0"}});
  EXPECT_NE(bad.status, 0);
  EXPECT_TRUE(contains(bad.err, "COHORT_HOST_CPUS=0 is not a number of CPUs; set it to 1 or more")) << bad.err;
}

TEST(DebugLog, InfoOverTcpNamesBothAddresses) {
  auto r = job({{"COHORT_DEBUG", "INFO"}, {"COHORT_DEBUG_SUBSYS", "INIT"}, {"COHORT_TRANSPORT", "tcp"}});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "[rank0]: cohort[rank 0] INFO INIT: group 0: peer 1 (world rank 1): transport tcp, same "
                              "host, COHORT_TRANSPORT=tcp, 127.0.0.1 -> 127.0.0.1:"))
      << r.err;
  EXPECT_FALSE(contains(r.err, "TUNING")) << "COHORT_DEBUG_SUBSYS=INIT must leave TUNING out:\n" << r.err;
}

TEST(DebugLog, TraceNamesEachCollectiveItsAlgorithmAndBytes) {
  auto small = job({{"COHORT_DEBUG", "TRACE"}, {"COHORT_DEBUG_SUBSYS", "COLL"}});
  ASSERT_EQ(small.status, 0) << small.err;
  EXPECT_TRUE(contains(small.err, "[rank1]: cohort[rank 1] TRACE COLL: allreduce #0 (f32 x 250, sum) 1000 bytes algo "
                                  "recursive_doubling"))
      << small.err;
  auto big = job({{"COHORT_DEBUG", "TRACE"}, {"COHORT_DEBUG_SUBSYS", "COLL"}}, {"131072"});
  ASSERT_EQ(big.status, 0) << big.err;
  EXPECT_TRUE(contains(big.err, "TRACE COLL: allreduce #0 (f32 x 32768, sum) 131072 bytes algo ring")) << big.err;
}

// From COHORT_SINGLE_COPY_BYTES (1 MiB) up, when the kernel lets the ranks
// read each other's memory: single copy, and INFO says whether it is on.
TEST(DebugLog, LargeAllreduceIsSingleCopyAndInfoSaysWhy) {
  auto r = job({{"COHORT_DEBUG", "TRACE"}, {"COHORT_DEBUG_SUBSYS", "COLL,NET,TUNING"}}, {"1048576"});
  ASSERT_EQ(r.status, 0) << r.err;
  if (contains(r.err, "single copy (process_vm_readv) off: "))
    GTEST_SKIP() << "this kernel or container forbids process_vm_readv between the ranks:\n" << r.err;
  EXPECT_TRUE(contains(r.err, "single copy (process_vm_readv) on")) << r.err;
  EXPECT_TRUE(contains(r.err, "recursive_doubling up to 16 KiB, ring above, single_copy from 1024 KiB (from 256 KiB when every rank's buffers are shared)")) << r.err;
  EXPECT_TRUE(contains(r.err, "TRACE COLL: allreduce #0 (f32 x 262144, sum) 1048576 bytes algo single_copy")) << r.err;

  // From 256 KiB only when every rank's buffers are shared: this program's are not, so the ring.
  auto mid = job({{"COHORT_DEBUG", "TRACE"}, {"COHORT_DEBUG_SUBSYS", "COLL"}}, {"262144"});
  ASSERT_EQ(mid.status, 0) << mid.err;
  EXPECT_TRUE(contains(mid.err, "262144 bytes algo single_copy if every rank's buffers are shared, else ring")) << mid.err;
  EXPECT_TRUE(contains(mid.err, "not every rank's buffers are shared: ring")) << mid.err;

  auto off = job({{"COHORT_DEBUG", "TRACE"}, {"COHORT_DEBUG_SUBSYS", "COLL"}, {"COHORT_SINGLE_COPY_BYTES", "0"}},
                 {"1048576"});
  ASSERT_EQ(off.status, 0) << off.err;
  EXPECT_TRUE(contains(off.err, "1048576 bytes algo ring")) << off.err;

  // Forced where it cannot run: over TCP the error names the reason and the knob.
  auto tcp = job({{"COHORT_TRANSPORT", "tcp"}, {"COHORT_ALGO", "allreduce=single_copy"}}, {"1048576"});
  EXPECT_NE(tcp.status, 0);
  EXPECT_TRUE(contains(tcp.err, "COHORT_ALGO asks for single_copy, but this group cannot use it: some peers are over tcp "
                                "(on other hosts, or COHORT_TRANSPORT=tcp)"))
      << tcp.err;
}

// `cohort bench --shared-buffers` allocates its buffers as DDP's buckets are
// (ProcessGroup::allocate_buffer): each rank maps its peer's and INFO says so;
// the results are checked. COHORT_SHARED_BUFFERS=0 turns it off.
TEST(DebugLog, SharedBuffersAreMappedByThePeer) {
  auto bench = [](const std::string& shared_knob) {
    return lt::run({"run", "--standalone", "--nproc-per-node", "2", COHORT_BIN, "bench", "allreduce", "--sizes", "512K,4M",
                    "-n", "2", "-w", "1", "--shared-buffers"},
                   {{"COHORT_DEBUG", "TRACE"}, {"COHORT_DEBUG_SUBSYS", "NET,COLL"}, {"COHORT_SINGLE_COPY_BYTES", ""},
                    {"COHORT_SINGLE_COPY_SHARED_BYTES", ""}, {"COHORT_TRANSPORT", ""}, {"COHORT_SHARED_BUFFERS", shared_knob}},
                   120);
  };
  auto r = bench("");
  ASSERT_EQ(r.status, 0) << r.err;
  if (contains(r.err, "single copy (process_vm_readv) off: "))
    GTEST_SKIP() << "this kernel or container forbids cross-process memory access between the ranks:\n" << r.err;
  EXPECT_TRUE(contains(r.out, "(shared buffers)")) << r.out;
  EXPECT_TRUE(contains(r.out, "Out of bounds values : 0 OK")) << r.out;
  for (int rank : {0, 1})
    EXPECT_TRUE(contains(r.err, "[rank" + std::to_string(rank) + "]: cohort[rank " + std::to_string(rank) +
                                    "] INFO NET: single copy maps peer " + std::to_string(1 - rank) + "'s shared buffer"))
        << r.err;
  EXPECT_FALSE(contains(r.err, "cannot map")) << r.err;
  // 512 KiB: below COHORT_SINGLE_COPY_BYTES, single copy because every rank's buffers are shared.
  EXPECT_TRUE(contains(r.err, "524288 bytes algo single_copy if every rank's buffers are shared")) << r.err;
  EXPECT_FALSE(contains(r.err, "not every rank's buffers are shared")) << r.err;

  auto off = bench("0");
  ASSERT_EQ(off.status, 0) << off.err;
  EXPECT_TRUE(contains(off.out, "Out of bounds values : 0 OK")) << off.out;
  EXPECT_FALSE(contains(off.err, "maps peer")) << off.err;
  EXPECT_TRUE(contains(off.err, "not every rank's buffers are shared: ring")) << off.err;
}

TEST(DebugLog, WarnIsTheDefaultAndQuiet) {
  auto r = job({});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_FALSE(contains(r.err, "cohort[rank")) << r.err;
  EXPECT_FALSE(contains(r.err, "INFO")) << r.err;
}

TEST(DebugLog, LauncherPrintsTheBindingAtInfo) {
  auto r = lt::run({"run", "--standalone", "--nproc-per-node", "1", "/bin/true"},
                   {{"COHORT_DEBUG", "INFO"}, {"COHORT_DEBUG_SUBSYS", "LAUNCH"}});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "INFO LAUNCH: --bind auto (none): workers are not pinned")) << r.err;
}
