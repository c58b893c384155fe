// allgather_coalesced / reduce_scatter_coalesced: many pairs in one call give
// what one call per pair gives (closed-form values), on shm and tcp at 1 to 4
// ranks, including an empty pair; the results are there after wait() or once
// is_completed() says so; lists that do not fit are refused naming the pair.
#include <gtest/gtest.h>

#include <thread>

#include "cohort/process_group.hpp"
#include "test_util.hpp"

namespace cohort {
namespace {

using testing::run_ranks;

struct Param {
  std::string transport;
  int world;
};
void PrintTo(const Param& p, std::ostream* os) { *os << p.transport << " x " << p.world; }
class Coalesced : public ::testing::TestWithParam<Param> {};

// Pair sizes per rank (elements): an empty one, a small one, one across a single-copy piece.
const std::vector<size_t> kCounts = {5, 0, 1, 70000, 3};

TEST_P(Coalesced, AllgatherEqualsOneCallPerPair) {
  const auto [transport, world] = GetParam();
  run_ranks(world, transport, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    std::vector<std::vector<double>> in, out;
    std::vector<Buffer> send, recv;
    for (size_t i = 0; i < kCounts.size(); ++i) {
      in.emplace_back(kCounts[i]);
      for (size_t k = 0; k < kCounts[i]; ++k) in[i][k] = 1000.0 * r + 10.0 * i + static_cast<double>(k % 7);
      out.emplace_back(kCounts[i] * world, -1.0);
    }
    for (size_t i = 0; i < kCounts.size(); ++i) {
      send.push_back({in[i].data(), kCounts[i], DType::F64});
      recv.push_back({out[i].data(), kCounts[i] * world, DType::F64});
    }
    pg.allgather_coalesced(send, recv)->wait();
    for (size_t i = 0; i < kCounts.size(); ++i)
      for (int q = 0; q < world; ++q)
        for (size_t k = 0; k < kCounts[i]; ++k)
          ASSERT_EQ(out[i][q * kCounts[i] + k], 1000.0 * q + 10.0 * i + static_cast<double>(k % 7))
              << "rank " << r << " pair " << i << " from rank " << q << " element " << k;
  });
}

TEST_P(Coalesced, ReduceScatterEqualsOneCallPerPair) {
  const auto [transport, world] = GetParam();
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max})
    run_ranks(world, transport, [&](ProcessGroup& pg) {
      const int r = pg.rank();
      std::vector<std::vector<float>> in, out;
      std::vector<Buffer> send, recv;
      for (size_t i = 0; i < kCounts.size(); ++i) {
        in.emplace_back(kCounts[i] * world);
        // Element k of block q on rank r: r + q + i + (k % 5), small integers (exact in float).
        for (int q = 0; q < world; ++q)
          for (size_t k = 0; k < kCounts[i]; ++k) in[i][q * kCounts[i] + k] = static_cast<float>(r + q + i + k % 5);
        out.emplace_back(kCounts[i], -1.0f);
      }
      for (size_t i = 0; i < kCounts.size(); ++i) {
        send.push_back({in[i].data(), kCounts[i] * world, DType::F32});
        recv.push_back({out[i].data(), kCounts[i], DType::F32});
      }
      WorkPtr w = pg.reduce_scatter_coalesced(send, recv, {.op = op});
      while (!w->is_completed()) std::this_thread::yield();  // the results are there once it says so
      const double ranks_sum = world * (world - 1) / 2.0;
      for (size_t i = 0; i < kCounts.size(); ++i)
        for (size_t k = 0; k < kCounts[i]; ++k) {
          const double base = r + i + k % 5;  // block r of every rank: q = r
          const double want = op == ReduceOp::Sum ? world * base + ranks_sum
                              : op == ReduceOp::Avg ? base + ranks_sum / world
                                                    : base + (world - 1);
          ASSERT_NEAR(out[i][k], want, 1e-4) << "rank " << r << " pair " << i << " element " << k << " op "
                                              << reduce_op_name(op);
        }
      w->wait();  // after is_completed, wait() returns at once and unpacks nothing twice
    });
}

std::vector<Param> params() {
  std::vector<Param> p;
  for (const char* t : {"shm", "tcp"})
    for (int w = 1; w <= 4; ++w) p.push_back({t, w});
  return p;
}
INSTANTIATE_TEST_SUITE_P(All, Coalesced, ::testing::ValuesIn(params()), [](const auto& info) {
  return info.param.transport + "_np" + std::to_string(info.param.world);
});

TEST(CoalescedErrors, PairsThatDoNotFitAreNamed) {
  run_ranks(2, "shm", [&](ProcessGroup& pg) {
    std::vector<float> a(4), b(8);
    std::vector<double> d(8);
    const auto expect = [](auto&& call, const std::string& words) {
      try {
        call();
        ADD_FAILURE() << "no error; expected one naming: " << words;
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
      }
    };
    expect([&] { pg.allgather_coalesced({{a.data(), 4}}, {}); }, "1 send buffers but 0 recv buffers");
    expect([&] { pg.allgather_coalesced({{a.data(), 4}, {a.data(), 4}}, {{b.data(), 8}, {b.data(), 7}}); },
           "pair 1 has 4 elements to send and 7 to receive");
    expect([&] { pg.reduce_scatter_coalesced({{b.data(), 8}, {d.data(), 8, DType::F64}}, {{a.data(), 4}, {d.data(), 4, DType::F64}}); },
           "pair 1 is f64 -> f64, pair 0 is f32");
  });
}

}  // namespace
}  // namespace cohort
