// Every collective x transport x world size x count x dtype x op, ranks as
// threads, closed-form expected values (docs/design.md habit 7).
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "collective_checks.hpp"
#include "test_util.hpp"

namespace cohort {
namespace {

using testing::run_ranks;
using namespace checks;

struct Param {
  std::string transport;
  int world;
};

void PrintTo(const Param& p, std::ostream* os) {
  *os << p.transport << " x " << p.world << " ranks";
}

// "tcp_striped": TCP with 3 sockets per pair and striping from 1 KiB up, so
// that messages really are cut over several sockets.
std::string base_transport(const std::string& name) {
  if (name == "tcp_striped") return "tcp";
  if (name == "shm_single_copy") return "shm";
  return name;
}

class Collectives : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    if (GetParam().transport == "tcp_striped") {
      setenv("COHORT_NSOCKS_PER_PEER", "3", 1);
      setenv("COHORT_NSOCKS_MIN_BYTES", "1K", 1);
    }
    // Every allreduce, of any size, by single copy (process_vm_readv/writev; the
    // ranks are threads of this process here, real processes in bench_check_test).
    // reduce_scatter and allgather by single copy need shared buffers: check_allgather_reduce_scatter has both.
    if (GetParam().transport == "shm_single_copy") {
      setenv("COHORT_SINGLE_COPY_BYTES", "1", 1);
      setenv("COHORT_SINGLE_COPY_SHARED_BYTES", "1", 1);
    }
  }
  void TearDown() override {
    unsetenv("COHORT_NSOCKS_PER_PEER");
    unsetenv("COHORT_NSOCKS_MIN_BYTES");
    unsetenv("COHORT_SINGLE_COPY_BYTES");
    unsetenv("COHORT_SINGLE_COPY_SHARED_BYTES");
  }
};

TEST_P(Collectives, AllreduceEveryDtypeAndOp) {
  auto [transport_name, n] = GetParam();
  const std::string transport = base_transport(transport_name);
  run_ranks(n, transport, check_allreduce_every_dtype_and_op);
}

TEST_P(Collectives, AllreduceLargeF32) {
  auto [transport_name, n] = GetParam();
  const std::string transport = base_transport(transport_name);
  run_ranks(n, transport, check_allreduce_large_f32);
}

TEST_P(Collectives, AllreduceSharedBuffers) {
  auto [transport_name, n] = GetParam();
  const std::string transport = base_transport(transport_name);
  run_ranks(n, transport, check_allreduce_shared_buffers);
}

TEST_P(Collectives, AllreduceGathered) {
  auto [transport_name, n] = GetParam();
  const std::string transport = base_transport(transport_name);
  run_ranks(n, transport, check_allreduce_gathered);
}

TEST_P(Collectives, BroadcastReduceEveryRoot) {
  auto [transport_name, n] = GetParam();
  const std::string transport = base_transport(transport_name);
  run_ranks(n, transport, check_broadcast_reduce_every_root);
}

TEST_P(Collectives, AllgatherReduceScatter) {
  auto [transport_name, n] = GetParam();
  const std::string transport = base_transport(transport_name);
  run_ranks(n, transport, check_allgather_reduce_scatter);
}

TEST_P(Collectives, AllgatherPushingIntoSharedOutputs) {
  auto [transport_name, n] = GetParam();
  if (base_transport(transport_name) != "shm" || n == 1) GTEST_SKIP() << "single copy runs over shm between peers";
  if (collectives::allgather_push_min() == SIZE_MAX && core::stream_copy_min() == SIZE_MAX)
    GTEST_SKIP() << "COHORT_ALLGATHER_PUSH_BYTES=0 and no streaming stores on this architecture: nothing pushes";
  run_ranks(n, "shm", check_allgather_pushing);
}

TEST_P(Collectives, GatherScatterAlltoall) {
  auto [transport_name, n] = GetParam();
  const std::string transport = base_transport(transport_name);
  run_ranks(n, transport, check_gather_scatter_alltoall);
}

TEST_P(Collectives, SendRecvRing) {
  auto [transport_name, n] = GetParam();
  const std::string transport = base_transport(transport_name);
  if (n == 1) GTEST_SKIP() << "needs a peer";
  run_ranks(n, transport, check_send_recv_ring);
}

TEST_P(Collectives, ManyAsyncOpsCompleteInOrder) {
  auto [transport_name, n] = GetParam();
  const std::string transport = base_transport(transport_name);
  run_ranks(n, transport, check_many_async_ops_complete_in_order);
}

// Two messages to (and from) the same peer in one batch: they go in order,
// not interleaved on the connection (sizes straddling the slot and chunk sizes).
TEST_P(Collectives, BatchWithTwoMessagesToTheSamePeer) {
  auto [transport_name, n] = GetParam();
  if (n == 1) GTEST_SKIP() << "needs a peer";
  run_ranks(n, base_transport(transport_name), [](ProcessGroup& pg) {
    const int me = pg.rank(), right = (me + 1) % pg.size(), left = (me + pg.size() - 1) % pg.size();
    for (size_t count : {size_t{16}, size_t{70000}, size_t{3000000}}) {
      std::vector<float> a(count), b(2 * count), ra(count, -1), rb(2 * count, -1);
      for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(me * 1000 + i % 997);
      for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(-me * 1000 - static_cast<float>(i % 991));
      pg.batch_isend_irecv({{P2POp::Send, buffer(a), right}, {P2POp::Send, buffer(b), right},
                            {P2POp::Recv, buffer(ra), left}, {P2POp::Recv, buffer(rb), left}})
          ->wait();
      for (size_t i = 0; i < ra.size(); ++i)
        ASSERT_EQ(ra[i], static_cast<float>(left * 1000 + i % 997)) << "first message, element " << i;
      for (size_t i = 0; i < rb.size(); ++i)
        ASSERT_EQ(rb[i], static_cast<float>(-left * 1000 - static_cast<float>(i % 991))) << "second, element " << i;
    }
    std::vector<float> x(8, 1.0f);
    pg.allreduce(buffer(x))->wait();  // the connection is still in step
    EXPECT_EQ(x[0], static_cast<float>(pg.size()));
  });
}

// Point-to-point calls are not numbered with the collectives: a rank that
// sent, one that received and one that did neither then agree on the
// collective that follows (a pipeline's first, middle and last stage).
TEST_P(Collectives, PointToPointDoesNotShiftCollectiveNumbers) {
  auto [transport_name, n] = GetParam();
  if (n < 3) GTEST_SKIP() << "needs a rank that takes no part";
  run_ranks(n, base_transport(transport_name), [](ProcessGroup& pg) {
    std::vector<int32_t> v(4, 7);
    if (pg.rank() == 0) pg.send(buffer(v), 1)->wait();
    if (pg.rank() == 1) pg.recv(buffer(v), 0)->wait();
    std::vector<float> x(8, 1.0f);
    pg.allreduce(buffer(x))->wait();
    EXPECT_EQ(x[0], static_cast<float>(pg.size()));
  });
}

// Scatter off the root may pass no send buffer at all; in place or
// overlapping buffers give the same results as separate ones.
TEST_P(Collectives, ScatterWithoutSendOffRootAndOverlappingBuffers) {
  auto [transport_name, n] = GetParam();
  run_ranks(n, base_transport(transport_name), [n = n](ProcessGroup& pg) {
    const size_t per = 5, total = per * n;
    std::vector<int32_t> all(total), part(per, -1);
    for (size_t i = 0; i < total; ++i) all[i] = static_cast<int32_t>(i);
    pg.scatter(pg.rank() == 0 ? buffer(all) : Buffer{}, buffer(part), {.root = 0})->wait();
    for (size_t i = 0; i < per; ++i) ASSERT_EQ(part[i], static_cast<int32_t>(pg.rank() * per + i));

    // reduce_scatter with recv at the start of send (not this rank's block).
    std::vector<float> buf(total);
    for (size_t i = 0; i < total; ++i) buf[i] = static_cast<float>(i);
    pg.reduce_scatter(buffer(buf), Buffer{buf.data(), per, DType::F32})->wait();
    for (size_t i = 0; i < per; ++i)
      ASSERT_EQ(buf[i], static_cast<float>(n * (pg.rank() * per + i))) << "reduce_scatter element " << i;
    // allgather in place (this rank's block already in recv), and alltoall in place.
    std::vector<float> g(total, -1);
    for (size_t i = 0; i < per; ++i) g[pg.rank() * per + i] = static_cast<float>(pg.rank());
    pg.allgather(Buffer{g.data() + pg.rank() * per, per, DType::F32}, buffer(g))->wait();
    for (size_t i = 0; i < total; ++i) ASSERT_EQ(g[i], static_cast<float>(i / per)) << "allgather element " << i;
    std::vector<float> t(total);
    for (size_t i = 0; i < total; ++i) t[i] = static_cast<float>(pg.rank() * 100 + i / per);
    pg.alltoall(buffer(t), buffer(t))->wait();
    for (size_t i = 0; i < total; ++i)
      ASSERT_EQ(t[i], static_cast<float>((i / per) * 100 + pg.rank())) << "alltoall element " << i;
  });
}

// wait(timeout) returns after the caller's timeout, not the operation's; the
// operation goes on and a later wait() sees it complete.
TEST(Work, WaitWithATimeoutOfItsOwn) {
  run_ranks(2, "shm", [](ProcessGroup& pg) {
    std::vector<float> x(1 << 20, 1.0f);  // 4 MiB: queued, not run inline
    if (pg.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    auto w = pg.allreduce(buffer(x));
    if (pg.rank() == 0) {
      const auto t0 = std::chrono::steady_clock::now();
      EXPECT_THROW(w->wait(std::chrono::milliseconds(200)), TimeoutError);
      EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(1200));
    }
    w->wait();
    EXPECT_EQ(x[0], 2.0f);
  });
}

std::vector<Param> params() {
  std::vector<Param> p;
  for (std::string t : {"shm", "tcp"})
    for (int n : {1, 2, 3, 4, 5, 8}) p.push_back({t, n});
  for (int n : {2, 3}) p.push_back({"tcp_striped", n});
  for (int n : {2, 3, 4, 5}) p.push_back({"shm_single_copy", n});
  return p;
}

INSTANTIATE_TEST_SUITE_P(All, Collectives, ::testing::ValuesIn(params()), [](const ::testing::TestParamInfo<Param>& i) {
  return i.param.transport + "_np" + std::to_string(i.param.world);
});

}  // namespace
}  // namespace cohort
