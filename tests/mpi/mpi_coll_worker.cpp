// The collective suite on the mpi backend: one process per rank, started by
// `mpirun -np N mpi_coll_worker` (tests/mpi_backend_test.cpp does that for
// N = 1..4). Every rank runs the same checks in the same order
// (tests/collective_checks.hpp, shared with the native backend's suite), plus
// what only this backend has: sub-groups as MPI communicators, small and
// large messages on both sides of COHORT_MPI_BLOCKING_BYTES, and its errors.
//
//   mpi_coll_worker [gtest flags]   the suite; exit 0 when every check passed on this rank
//   mpi_coll_worker hang            rank 0 calls an allreduce the others never join:
//                                   the watchdog must end it (exit 124) after COHORT_TIMEOUT
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "collective_checks.hpp"
#include "core/env.hpp"

namespace cohort {
namespace {

using namespace checks;

std::shared_ptr<ProcessGroup> g_world;

ProcessGroup& world() {
  return *g_world;
}

TEST(MpiCollectives, Backend) {
  EXPECT_EQ(world().backend_name(), "mpi");
  EXPECT_EQ(static_cast<int>(world().world_ranks().size()), world().size());
}

TEST(MpiCollectives, AllreduceEveryDtypeAndOp) {
  check_allreduce_every_dtype_and_op(world());
}
TEST(MpiCollectives, AllreduceLargeF32) {
  check_allreduce_large_f32(world());
}
TEST(MpiCollectives, BroadcastReduceEveryRoot) {
  check_broadcast_reduce_every_root(world());
}
TEST(MpiCollectives, AllgatherReduceScatter) {
  check_allgather_reduce_scatter(world());
}
TEST(MpiCollectives, GatherScatterAlltoall) {
  check_gather_scatter_alltoall(world());
}
TEST(MpiCollectives, SendRecvRing) {
  if (world().size() == 1) GTEST_SKIP() << "needs a peer";
  check_send_recv_ring(world());
}
TEST(MpiCollectives, ManyAsyncOpsCompleteInOrder) {
  check_many_async_ops_complete_in_order(world());
}

// Large (progress thread) and small (caller's thread when the queue is empty)
// allreduces, broadcasts and barriers issued interleaved before any wait: the
// small ones queue behind the large ones, so every rank's MPI calls stay in
// the same order, and each result is right whatever order they are waited in.
TEST(MpiCollectives, InterleavedLargeAndSmallAsyncKeepOrder) {
  ProcessGroup& pg = world();
  const int n = pg.size(), me = pg.rank();
  const float sum_ranks = float(n * (n - 1) / 2);
  constexpr int kRounds = 6;
  std::vector<std::vector<float>> big(kRounds, std::vector<float>(300000));  // 1.2 MB: above 64K
  std::vector<std::vector<float>> small(kRounds, std::vector<float>(3));
  std::vector<std::vector<int32_t>> bc(kRounds, std::vector<int32_t>(5));
  std::vector<WorkPtr> works;
  for (int k = 0; k < kRounds; ++k) {
    std::fill(big[k].begin(), big[k].end(), float(me + k));
    std::fill(small[k].begin(), small[k].end(), float(me * 2 + k));
    std::fill(bc[k].begin(), bc[k].end(), me == k % n ? 100 + k : -1);
    works.push_back(pg.allreduce(buffer(big[k])));
    works.push_back(pg.allreduce(buffer(small[k]), {.op = ReduceOp::Max}));
    works.push_back(pg.broadcast(buffer(bc[k]), {.root = k % n}));
    if (k % 2 == 1) works.push_back(pg.barrier());
  }
  for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait();  // the last first
  for (int k = 0; k < kRounds; ++k) {
    EXPECT_EQ(big[k].front(), sum_ranks + float(n * k)) << k;
    EXPECT_EQ(big[k].back(), sum_ranks + float(n * k)) << k;
    EXPECT_EQ(small[k][2], float((n - 1) * 2 + k)) << k;
    EXPECT_EQ(bc[k][4], 100 + k) << k;
  }
  for (auto& w : works) EXPECT_TRUE(w->is_completed());
  // A small call right after large ones, then a point-to-point one: both wait their turn.
  auto w1 = pg.allreduce(buffer(big[0]));
  std::vector<float> one{1.0f};
  pg.allreduce(buffer(one))->wait();
  EXPECT_EQ(one[0], float(n));
  EXPECT_TRUE(w1->is_completed());  // issued before: finished before the small one
}

// Work::test (is_completed) polled without wait: the progress thread completes the work on its own.
TEST(MpiCollectives, IsCompletedPollsToCompletion) {
  ProcessGroup& pg = world();
  const int n = pg.size();
  std::vector<double> v(500000, 1.0);  // 4 MB
  auto w = pg.allreduce(buffer(v), {.op = ReduceOp::Avg});
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  int polls = 0;
  while (!w->is_completed() && std::chrono::steady_clock::now() < until) {
    ++polls;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  ASSERT_TRUE(w->is_completed()) << "after " << polls << " polls";
  EXPECT_EQ(w->error(), nullptr);
  EXPECT_EQ(v.front(), 1.0);
  EXPECT_EQ(v.back(), 1.0);
  w->wait();  // completed: returns at once
  (void)n;
}

// A wait shorter than the operation's own timeout on a Work still queued or
// running throws TimeoutError naming it; the Work can be waited on again.
TEST(MpiCollectives, ShortWaitOnQueuedWorkTimesOut) {
  ProcessGroup& pg = world();
  std::vector<std::vector<float>> v(4, std::vector<float>(2000000, 1.0f));  // 8 MB each
  std::vector<WorkPtr> ws;
  for (auto& b : v) ws.push_back(pg.allreduce(buffer(b)));
  // The last of four 8 MB allreduces is rarely done within a millisecond; if it is, nothing to check.
  try {
    ws.back()->wait(Millis(1));
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("allreduce"), std::string::npos) << e.what();
  }
  for (auto& w : ws) w->wait();
  for (auto& b : v) EXPECT_EQ(b.back(), float(pg.size()));
}

// Works nobody waits on: a group's shutdown completes its queued calls first,
// and a later small call on another group queues behind them.
TEST(MpiCollectives, ShutdownCompletesUnwaitedWork) {
  ProcessGroup& pg = world();
  const int n = pg.size();
  std::vector<int> all(n);
  for (int r = 0; r < n; ++r) all[r] = r;
  auto sub = pg.new_group(all);
  ASSERT_NE(sub, nullptr);
  std::vector<std::vector<int32_t>> v(3, std::vector<int32_t>(100000, 2));  // 400 KB each
  std::vector<int32_t> w(100000, 3);
  for (auto& b : v) (void)sub->allreduce(buffer(b));
  (void)pg.allreduce(buffer(w));
  sub->shutdown();
  for (auto& b : v) EXPECT_EQ(b.back(), 2 * n);
  pg.barrier()->wait();
  EXPECT_EQ(w.back(), 3 * n);
}

// Everyone sends to the right and receives from the left in one batch, small
// (blocking path) and large (a Work completed by wait).
TEST(MpiCollectives, BatchIsendIrecvRing) {
  ProcessGroup& pg = world();
  const int n = pg.size(), me = pg.rank();
  if (n == 1) GTEST_SKIP() << "needs a peer";
  const int right = (me + 1) % n, left = (me - 1 + n) % n;
  for (size_t count : {size_t(1), size_t(100000)}) {
    std::vector<int64_t> out(count, me * 10 + 1), in(count, -1);
    auto w = pg.batch_isend_irecv({{P2POp::Send, buffer(out), right, 5}, {P2POp::Recv, buffer(in), left, 5}});
    w->wait();
    EXPECT_TRUE(w->is_completed());
    EXPECT_EQ(in.front(), left * 10 + 1);
    EXPECT_EQ(in.back(), left * 10 + 1);
  }
}

// Sub-groups are MPI communicators: the even ranks in reverse order, and a
// sub-group of that sub-group.
TEST(MpiCollectives, SubGroups) {
  ProcessGroup& pg = world();
  const int n = pg.size(), me = pg.rank();
  std::vector<int> evens;
  for (int r = n - 1; r >= 0; --r)
    if (r % 2 == 0) evens.push_back(r);
  auto sub = pg.new_group(evens);
  if (me % 2 != 0) {
    EXPECT_EQ(sub, nullptr);
    return;
  }
  ASSERT_NE(sub, nullptr);
  const int m = static_cast<int>(evens.size());
  EXPECT_EQ(sub->size(), m);
  EXPECT_EQ(sub->world_ranks()[sub->rank()], me);
  EXPECT_EQ(evens[sub->rank()], me);
  for (size_t count : {size_t(3), size_t(50000)}) {
    std::vector<float> v(count, float(me));
    sub->allreduce(buffer(v))->wait();
    float want = 0;
    for (int r : evens) want += float(r);
    EXPECT_EQ(v.front(), want);
    EXPECT_EQ(v.back(), want);
  }
  check_allgather_reduce_scatter(*sub);
  auto first = sub->new_group({0});
  if (sub->rank() == 0) {
    ASSERT_NE(first, nullptr);
    EXPECT_EQ(first->size(), 1);
    std::vector<int32_t> v{7};
    first->allreduce(buffer(v))->wait();
    EXPECT_EQ(v[0], 7);
  } else {
    EXPECT_EQ(first, nullptr);
  }
  sub->shutdown();
  std::vector<float> v(1);
  EXPECT_THROW(sub->allreduce(buffer(v)), InvalidArgument);
}

// Bad arguments throw at the call, naming what was wrong, on this rank alone.
TEST(MpiCollectives, BadArgumentsThrow) {
  ProcessGroup& pg = world();
  std::vector<float> a(4), b(5);
  try {
    pg.allreduce(buffer(a), buffer(b));
    ADD_FAILURE() << "no exception";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("send has 4 elements but recv has 5"), std::string::npos) << e.what();
  }
  EXPECT_THROW(pg.broadcast(buffer(a), {.root = pg.size()}), InvalidArgument);
  EXPECT_THROW(pg.send(buffer(a), pg.rank()), InvalidArgument);
  InitOptions o;
  o.backend = "mpi";
  o.world_size = pg.size() + 1;
  try {
    init_process_group(o);
    ADD_FAILURE() << "no exception";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("is not MPI's"), std::string::npos) << e.what();
  }
}

// A Work waited with a short timeout on an operation that cannot finish yet
// (its peer has not sent) throws TimeoutError and can be waited again; a
// point-to-point Work does not hold up the calls issued after it.
TEST(MpiCollectives, ShortWaitTimesOutThenCompletes) {
  ProcessGroup& pg = world();
  if (pg.size() == 1) GTEST_SKIP() << "needs a peer";
  const char* bb = std::getenv("COHORT_MPI_BLOCKING_BYTES");
  auto limit = core::parse_bytes(bb != nullptr && *bb != '\0' ? bb : "64K");
  if (limit && *limit >= 400000)
    GTEST_SKIP() << "needs the receive to be nonblocking (COHORT_MPI_BLOCKING_BYTES < 400000)";
  std::vector<float> v(100000, 1.0f), go(1, 1.0f);  // v: above COHORT_MPI_BLOCKING_BYTES, nonblocking
  if (pg.rank() == 0) {
    auto w = pg.recv(buffer(v), 1, {.tag = 9});
    EXPECT_THROW(w->wait(Millis(20)), TimeoutError);
    EXPECT_FALSE(w->is_completed());
    pg.send(buffer(go), 1, {.tag = 10})->wait();  // now rank 1 sends
    w->wait();
    EXPECT_TRUE(w->is_completed());
    EXPECT_EQ(v[0], 2.0f);
    EXPECT_EQ(v[99999], 2.0f);
  } else if (pg.rank() == 1) {
    pg.recv(buffer(go), 0, {.tag = 10})->wait();
    std::vector<float> two(100000, 2.0f);
    pg.send(buffer(two), 0, {.tag = 9})->wait();
  }
  pg.barrier()->wait();
}

}  // namespace
}  // namespace cohort

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  cohort::InitOptions o;
  o.backend = "mpi";
  try {
    cohort::g_world = cohort::init_process_group(o);
  } catch (const cohort::Error& e) {
    std::fprintf(stderr, "ERROR: %s\n", e.what());
    return 3;
  }
  if (argc > 1 && std::strcmp(argv[1], "hang") == 0) {
    std::vector<float> v(4, 1.0f);
    if (cohort::g_world->rank() == 0) {
      cohort::g_world->allreduce(cohort::buffer(v))->wait();  // nobody joins: the watchdog exits
      std::printf("allreduce returned\n");
      return 0;
    }
    std::this_thread::sleep_for(std::chrono::seconds(60));  // mpirun stops us when rank 0 exits
    return 0;
  }
  int rc = RUN_ALL_TESTS();
  cohort::g_world->shutdown();
  cohort::g_world.reset();
  return rc;
}
