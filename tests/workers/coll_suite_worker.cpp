// The collective suite on the native backend with one process per rank,
// started by `cohort run` (tests/hierarchical_test.cpp runs it with ranks on
// several "hosts": COHORT_HOST_ID per process, or network namespaces). Every
// rank runs the same checks in the same order (tests/collective_checks.hpp,
// shared with the threads-as-ranks suite and the mpi backend's).
//
//   coll_suite_worker [gtest flags]   exit 0 when every check passed on this rank
// (COHORT_DEBUG=TRACE COHORT_DEBUG_SUBSYS=COLL logs the algorithm of each call.)
#include <cstdio>

#include "collective_checks.hpp"

namespace cohort {
namespace {

using namespace checks;

std::shared_ptr<ProcessGroup> g_world;

ProcessGroup& world() { return *g_world; }

TEST(Suite, AllreduceEveryDtypeAndOp) { check_allreduce_every_dtype_and_op(world()); }
TEST(Suite, AllreduceLargeF32) { check_allreduce_large_f32(world()); }
TEST(Suite, AllreduceSharedBuffers) { check_allreduce_shared_buffers(world()); }
TEST(Suite, AllreduceGathered) { check_allreduce_gathered(world()); }
TEST(Suite, BroadcastReduceEveryRoot) { check_broadcast_reduce_every_root(world()); }
TEST(Suite, AllgatherReduceScatter) { check_allgather_reduce_scatter(world()); }
TEST(Suite, GatherScatterAlltoall) { check_gather_scatter_alltoall(world()); }
TEST(Suite, SendRecvRing) {
  if (world().size() == 1) GTEST_SKIP() << "needs a peer";
  check_send_recv_ring(world());
}
TEST(Suite, ManyAsyncOpsCompleteInOrder) { check_many_async_ops_complete_in_order(world()); }

// Sub-groups inherit the layout: the ranks with one local index, and a group
// of two hosts' first ranks, run the suite's allreduce too.
TEST(Suite, SubGroups) {
  ProcessGroup& pg = world();
  std::vector<int> evens;
  for (int r = 0; r < pg.size(); r += 2) evens.push_back(r);
  auto sub = pg.new_group(evens);
  if (sub) check_allreduce_every_dtype_and_op(*sub);
  pg.barrier()->wait();
}

}  // namespace
}  // namespace cohort

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  try {
    cohort::g_world = cohort::init_process_group();
  } catch (const cohort::Error& e) {
    std::fprintf(stderr, "ERROR: %s\n", e.what());
    return 3;
  }
  int rc = RUN_ALL_TESTS();
  cohort::g_world->shutdown();
  cohort::g_world.reset();
  return rc;
}
