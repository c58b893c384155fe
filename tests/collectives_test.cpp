// Every collective x transport x world size x count x dtype x op, ranks as
// threads, closed-form expected values (DESIGN.md habit 7).
#include <gtest/gtest.h>

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
    if (GetParam().transport == "shm_single_copy") setenv("COHORT_SINGLE_COPY_BYTES", "1", 1);
  }
  void TearDown() override {
    unsetenv("COHORT_NSOCKS_PER_PEER");
    unsetenv("COHORT_NSOCKS_MIN_BYTES");
    unsetenv("COHORT_SINGLE_COPY_BYTES");
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
