// DistributedDataParallel with real LibTorch modules: after a DDP step every
// rank holds the gradients one process computes on the whole global batch.
// Ranks run as threads over a MemoryStore (tests/test_util.hpp).
#include <gtest/gtest.h>
#include <algorithm>
#include <cstring>
#include <limits>

#include <ATen/autocast_mode.h>

#include "cohort/torch.hpp"
#include "cohort/torch_train.hpp"
#include "test_util.hpp"
#include "torch/ddp_test_model.hpp"

namespace {

using cohort::testing::run_ranks;

using ddp_test::inputs;
using ddp_test::Net;
using ddp_test::targets;

// Gradients of one process over `micro` global micro-batches of `global` samples each (accumulated).
std::vector<torch::Tensor> reference_grads(int64_t global, int micro) {
  Net net;
  for (int m = 0; m < micro; ++m) {
    auto loss = torch::mse_loss(net->forward(inputs(m * global, global)), targets(m * global, global));
    loss.backward();
  }
  std::vector<torch::Tensor> g;
  for (auto& p : net->parameters()) g.push_back(p.grad().clone());
  return g;
}

// Copies of a module's gradients, in parameter order.
std::vector<torch::Tensor> grads_of(const torch::nn::Module& m) {
  std::vector<torch::Tensor> g;
  for (const auto& p : m.parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : p.grad());
  return g;
}

// Gradients of one process on samples [from, from + n) alone.
std::vector<torch::Tensor> grads_on(int64_t from, int64_t n) {
  Net net;
  torch::mse_loss(net->forward(inputs(from, n)), targets(from, n)).backward();
  return grads_of(*net);
}

void expect_close(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want, double tol, int rank) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(got[i].defined()) << "rank " << rank << " param " << i;
    double err = (got[i] - want[i]).abs().max().item<double>();
    EXPECT_LT(err, tol) << "rank " << rank << " param " << i << " max error " << err;
  }
}

using ddp_test::borrowed;

// Options with or without gradient_as_bucket_view; several_buckets: caps so
// small that even this model's few parameters fill several buckets.
cohort::torch::DistributedDataParallelOptions ddp_options(bool bucket_view, bool several_buckets = false) {
  cohort::torch::DistributedDataParallelOptions o;
  o.gradient_as_bucket_view = bucket_view;
  if (several_buckets) {
    o.bucket_cap_mb = 0.0005;
    o.first_bucket_mb = 0.0002;
  }
  return o;
}

struct Case {
  std::string transport;
  int world;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.transport << " x " << c.world; }
class Ddp : public ::testing::TestWithParam<Case> {};

constexpr int64_t kLocal = 4;

TEST_P(Ddp, GradientsEqualOneProcessOnTheGlobalBatch) {
  torch::set_num_threads(1);
  auto [transport, n] = GetParam();
  auto want = reference_grads(kLocal * n, 1);
  for (bool bucket_view : {false, true}) {
    run_ranks(n, transport, [&](cohort::ProcessGroup& pg) {
      auto pgp = borrowed(pg);
      Net net;
      auto o = ddp_options(bucket_view, /*several_buckets=*/true);
      cohort::torch::DistributedDataParallel ddp(net.ptr(), pgp, o);
      ddp.pre_forward();
      int64_t from = pg.rank() * kLocal;
      auto loss = torch::mse_loss(net->forward(inputs(from, kLocal)), targets(from, kLocal));
      loss.backward();  // averaged when it returns
      std::vector<torch::Tensor> got;
      for (auto& p : net->parameters()) got.push_back(p.grad());
      expect_close(got, want, 1e-5, pg.rank());
      EXPECT_GT(ddp.stats().buckets.size(), 1u);
    });
  }
}

TEST_P(Ddp, NoSyncAccumulatesThenSyncs) {
  torch::set_num_threads(1);
  auto [transport, n] = GetParam();
  auto want = reference_grads(kLocal * n, 2);
  run_ranks(n, transport, [&](cohort::ProcessGroup& pg) {
    auto pgp = borrowed(pg);
    Net net;
    cohort::torch::DistributedDataParallel ddp(net.ptr(), pgp);
    for (int m = 0; m < 2; ++m) {
      int64_t from = m * kLocal * n + pg.rank() * kLocal;
      ddp.pre_forward();
      auto loss = torch::mse_loss(net->forward(inputs(from, kLocal)), targets(from, kLocal));
      if (m == 0) {
        auto guard = ddp.no_sync();
        loss.backward();
      } else {
        loss.backward();
      }
    }
    std::vector<torch::Tensor> got;
    for (auto& p : net->parameters()) got.push_back(p.grad());
    expect_close(got, want, 1e-5, pg.rank());
  });
}

// Gradients set to none between steps (cohort::torch::zero_grad, PyTorch's
// default): the next backward's fresh gradients are copied into the buckets,
// the result is right, and with gradient_as_bucket_view .grad is the bucket
// view again afterwards (the same storage as after the first step).
TEST_P(Ddp, GradientsSetToNoneBetweenSteps) {
  torch::set_num_threads(1);
  auto [transport, n] = GetParam();
  const int64_t global = kLocal * n;
  auto want = grads_on(global, global);  // step 2 alone: the second global batch
  for (bool bucket_view : {false, true}) {
    run_ranks(n, transport, [&](cohort::ProcessGroup& pg) {
      auto pgp = borrowed(pg);
      Net net;
      auto o = ddp_options(bucket_view, /*several_buckets=*/true);
      cohort::torch::DistributedDataParallel ddp(net.ptr(), pgp, o);
      torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.0));  // lr 0: weights stay put
      std::vector<void*> storage;
      for (int step = 0; step < 2; ++step) {
        cohort::torch::zero_grad(opt);
        for (auto& p : net->parameters()) ASSERT_FALSE(p.grad().defined());
        ddp.pre_forward();
        int64_t from = step * global + pg.rank() * kLocal;
        torch::mse_loss(net->forward(inputs(from, kLocal)), targets(from, kLocal)).backward();
        opt.step();
        std::vector<void*> now;
        for (auto& p : net->parameters()) now.push_back(p.grad().data_ptr());
        if (step == 0) {
          storage = now;
        } else if (bucket_view && n > 1) {  // one rank: no hooks, plain LibTorch
          EXPECT_EQ(now, storage) << "rank " << pg.rank() << ": .grad is not the bucket view again";
        }
      }
      expect_close(grads_of(*net), want, 1e-5, pg.rank());
    });
  }
}

// Set to none, then a no_sync pass, then a synced one: the no_sync pass
// must leave autograd's fresh gradient in .grad (not the bucket slot, which
// holds the previous step's average), and the synced pass reduces the sum of
// both passes.
TEST_P(Ddp, NoSyncAfterGradientsSetToNone) {
  torch::set_num_threads(1);
  auto [transport, n] = GetParam();
  auto want = reference_grads(kLocal * n, 2);
  for (bool bucket_view : {false, true}) {
    run_ranks(n, transport, [&](cohort::ProcessGroup& pg) {
      auto pgp = borrowed(pg);
      Net net;
      auto o = ddp_options(bucket_view);
      cohort::torch::DistributedDataParallel ddp(net.ptr(), pgp, o);
      torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.0));
      auto pass = [&](int64_t m) {
        ddp.pre_forward();
        int64_t from = m * kLocal * n + pg.rank() * kLocal;
        return torch::mse_loss(net->forward(inputs(from, kLocal)), targets(from, kLocal));
      };
      pass(5).backward();  // a synced step on other data: the buckets now hold its average
      cohort::torch::zero_grad(opt);
      {
        auto guard = ddp.no_sync();
        pass(0).backward();
      }
      auto local = grads_of(*net);
      pass(1).backward();
      expect_close(grads_of(*net), want, 1e-5, pg.rank());
      // And after the no_sync pass alone, .grad was this rank's own gradient of micro-batch 0.
      expect_close(local, grads_on(pg.rank() * kLocal, kLocal), 1e-6, pg.rank());
    });
  }
}

// A parameter used in one step and not in the next, its gradient set to none
// in between (find_unused_parameters): no rank used it, so its gradient stays
// none on every rank, as in PyTorch: not the last step's average, not zeros,
// not a read of freed memory.
TEST_P(Ddp, UnusedAfterGradientsSetToNoneStaysNone) {
  torch::set_num_threads(1);
  auto [transport, n] = GetParam();
  if (n == 1) GTEST_SKIP() << "one rank registers no hooks: plain LibTorch leaves the gradient undefined";
  const int64_t global = kLocal * n;
  auto want = grads_on(global, global);
  for (bool bucket_view : {false, true}) {
    run_ranks(n, transport, [&](cohort::ProcessGroup& pg) {
      auto pgp = borrowed(pg);
      Net net(/*with_unused=*/true);
      auto o = ddp_options(bucket_view);
      o.find_unused_parameters = true;
      cohort::torch::DistributedDataParallel ddp(net.ptr(), pgp, o);
      torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.0));
      for (int step = 0; step < 2; ++step) {
        cohort::torch::zero_grad(opt);
        ddp.pre_forward();
        const int64_t from = step * global + pg.rank() * kLocal;
        auto loss = torch::mse_loss(net->forward(inputs(from, kLocal)), targets(from, kLocal));
        if (step == 0) loss = loss + 0.1 * net->spare->forward(inputs(from, kLocal).narrow(1, 0, 4)).sum();
        loss.backward();
      }
      // No rank used it in the last step: its gradient stays none (PyTorch), not a stale one, not zeros
      // (an optimizer with momentum or weight decay would move it on zeros).
      for (auto& p : net->spare->parameters()) EXPECT_FALSE(p.grad().defined()) << "rank " << pg.rank();
      std::vector<torch::Tensor> got;
      for (auto& p : net->fc1->parameters()) got.push_back(p.grad());
      for (auto& p : net->fc2->parameters()) got.push_back(p.grad());
      expect_close(got, want, 1e-5, pg.rank());
    });
  }
}

// With single copy for every size (COHORT_SINGLE_COPY_BYTES=1, as for DDP's
// large buckets on one host), each rank reduces its block of a bucket straight
// from autograd's fresh gradients (gradients set to none) and copies only the
// rest into the bucket. Two steps; with and without gradient_as_bucket_view;
// also under no_sync then sync, where the synced pass lends the accumulated
// gradient.
TEST_P(Ddp, OwnBlockReadFromAutogradsGradients) {
  torch::set_num_threads(1);
  auto [transport, n] = GetParam();
  const int64_t global = kLocal * n;
  setenv("COHORT_SINGLE_COPY_BYTES", "1", 1);
  for (bool bucket_view : {false, true}) {
    run_ranks(n, transport, [&](cohort::ProcessGroup& pg) {
      auto pgp = borrowed(pg);
      Net net;
      auto o = ddp_options(bucket_view, /*several_buckets=*/true);
      cohort::torch::DistributedDataParallel ddp(net.ptr(), pgp, o);
      torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.0));
      for (int step = 0; step < 2; ++step) {
        cohort::torch::zero_grad(opt);
        ddp.pre_forward();
        const int64_t from = step * global + pg.rank() * kLocal;
        torch::mse_loss(net->forward(inputs(from, kLocal)), targets(from, kLocal)).backward();
        expect_close(grads_of(*net), grads_on(step * global, global), 1e-5, pg.rank());
      }
      cohort::torch::zero_grad(opt);
      for (int m = 0; m < 2; ++m) {
        const int64_t from = m * global + pg.rank() * kLocal;
        ddp.pre_forward();
        auto loss = torch::mse_loss(net->forward(inputs(from, kLocal)), targets(from, kLocal));
        if (m == 0) {
          auto guard = ddp.no_sync();
          loss.backward();
        } else {
          loss.backward();
        }
      }
      expect_close(grads_of(*net), reference_grads(global, 2), 1e-5, pg.rank());
    });
  }
  unsetenv("COHORT_SINGLE_COPY_BYTES");
}

TEST_P(Ddp, CompressionHooksAreClose) {
  torch::set_num_threads(1);
  auto [transport, n] = GetParam();
  auto want = reference_grads(kLocal * n, 1);
  // The hook given in the options, then through register_comm_hook(). The
  // result must be close to the exact average, and must show the rounding of
  // the compressed type (f32 all the way would be within ~1e-7): a hook that
  // was never installed fails here.
  struct HookCase {
    const char* name;
    cohort::ddp::CommHook hook;
    double min_error;  // about the compressed type's rounding of these gradients (0.1-1)
  };
  for (const HookCase& hc : {HookCase{"fp16", cohort::ddp::fp16_compress_hook(), 1e-6},
                             HookCase{"bf16", cohort::ddp::bf16_compress_hook(), 1e-5}}) {
    for (const bool registered : {false, true}) {
      run_ranks(n, transport, [&](cohort::ProcessGroup& pg) {
        auto pgp = borrowed(pg);
        Net net;
        cohort::torch::DistributedDataParallelOptions o;
        if (!registered) o.comm_hook = hc.hook;
        cohort::torch::DistributedDataParallel ddp(net.ptr(), pgp, o);
        if (registered) ddp.register_comm_hook(hc.hook);
        ddp.pre_forward();
        int64_t from = pg.rank() * kLocal;
        torch::mse_loss(net->forward(inputs(from, kLocal)), targets(from, kLocal)).backward();
        std::vector<torch::Tensor> got;
        for (auto& p : net->parameters()) got.push_back(p.grad());
        expect_close(got, want, 2e-2, pg.rank());  // bf16 keeps 8 bits of mantissa
        if (n == 1) return;                        // one rank: no hooks, LibTorch's own gradients
        double max_err = 0;
        for (size_t i = 0; i < got.size(); ++i) max_err = std::max(max_err, (got[i] - want[i]).abs().max().item<double>());
        EXPECT_GT(max_err, hc.min_error) << hc.name << (registered ? " (register_comm_hook)" : " (options)")
                                         << ": no rounding in the result, so the hook did not run; rank " << pg.rank();
      });
    }
  }
}

TEST_P(Ddp, UnusedParametersWithFindUnused) {
  torch::set_num_threads(1);
  auto [transport, n] = GetParam();
  auto want = reference_grads(kLocal * n, 1);
  run_ranks(n, transport, [&](cohort::ProcessGroup& pg) {
    auto pgp = borrowed(pg);
    Net net(/*with_unused=*/true);
    cohort::torch::DistributedDataParallelOptions o;
    o.find_unused_parameters = true;
    cohort::torch::DistributedDataParallel ddp(net.ptr(), pgp, o);
    ddp.pre_forward();
    int64_t from = pg.rank() * kLocal;
    torch::mse_loss(net->forward(inputs(from, kLocal)), targets(from, kLocal)).backward();
    std::vector<torch::Tensor> got;
    for (auto& p : net->fc1->parameters()) got.push_back(p.grad());
    for (auto& p : net->fc2->parameters()) got.push_back(p.grad());
    expect_close(got, want, 1e-5, pg.rank());
    for (auto& p : net->spare->parameters()) EXPECT_TRUE(!p.grad().defined() || p.grad().abs().max().item<double>() == 0.0);
  });
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (int n : {1, 2, 3, 4}) v.push_back({"shm", n});
  v.push_back({"tcp", 2});
  v.push_back({"tcp", 3});
  return v;
}
INSTANTIATE_TEST_SUITE_P(All, Ddp, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.transport + "_np" + std::to_string(i.param.world); });

TEST(DdpErrors, UnusedParameterWithoutFindUnusedIsNamed) {
  torch::set_num_threads(1);
  std::vector<std::string> errs(2);
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    auto pgp = borrowed(pg);
    Net net(true);
    cohort::torch::DistributedDataParallel ddp(net.ptr(), pgp);
    ddp.pre_forward();
    try {
      torch::mse_loss(net->forward(inputs(0, 4)), targets(0, 4)).backward();
    } catch (const std::exception& e) {
      errs[pg.rank()] = e.what();
    }
  });
  for (auto& e : errs) {
    EXPECT_NE(e.find("spare.weight"), std::string::npos) << e;
    EXPECT_NE(e.find("find_unused_parameters"), std::string::npos) << e;
  }
}

TEST(DdpErrors, DifferentModelsAreNamed) {
  std::vector<std::string> errs(2);
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    auto pgp = borrowed(pg);
    Net net(pg.rank() == 1);  // rank 1 has an extra layer
    try {
      cohort::torch::DistributedDataParallel ddp(net.ptr(), pgp);
    } catch (const cohort::InvalidArgument& e) {
      errs[pg.rank()] = e.what();
    }
  });
  EXPECT_NE(errs[1].find("rank 1 has a parameter 'spare.weight"), std::string::npos) << errs[1];
  EXPECT_NE(errs[0].find("ranks [1] have different parameters than rank 0"), std::string::npos) << errs[0];
}

TEST(DdpErrors, BroadcastMakesReplicasEqual) {
  run_ranks(3, "shm", [&](cohort::ProcessGroup& pg) {
    auto pgp = borrowed(pg);
    Net net;
    {
      torch::NoGradGuard g;
      for (auto& p : net->parameters()) p.add_(pg.rank());  // replicas start different
    }
    cohort::torch::DistributedDataParallel ddp(net.ptr(), pgp);
    Net ref;
    auto a = net->parameters(), b = ref->parameters();
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "rank " << pg.rank();
  });
}

// Frozen parameters (requires_grad false) are not reduced, but every replica
// must still start from rank 0's values, as PyTorch's broadcast of the state does.
// A bool buffer (a mask) is broadcast too, as its bytes.
TEST(DdpErrors, FrozenParametersAndBoolBuffersAreBroadcast) {
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    auto pgp = borrowed(pg);
    Net net;
    auto emb = net->register_parameter("emb", torch::full({4}, pg.rank() + 1.0), /*requires_grad=*/false);
    auto mask = net->register_buffer("mask", torch::ones({3, 3}, torch::kBool).tril(pg.rank() == 0 ? 0 : -1));
    cohort::torch::DistributedDataParallel ddp(net.ptr(), pgp);
    EXPECT_TRUE(torch::equal(emb, torch::full({4}, 1.0))) << "rank " << pg.rank();
    EXPECT_TRUE(torch::equal(mask, torch::ones({3, 3}, torch::kBool).tril())) << "rank " << pg.rank();
  });
}

// A frozen parameter or a buffer that differs in shape between replicas is
// named at construction, on every rank, instead of failing inside the
// broadcast that follows the check.
TEST(DdpErrors, DifferentFrozenParametersAndBuffersAreNamed) {
  for (const bool buffer : {false, true}) {
    std::vector<std::string> errs(2);
    run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
      auto pgp = borrowed(pg);
      Net net;
      const auto t = torch::zeros({pg.rank() == 0 ? 4 : 5}, torch::kBool);
      if (buffer) net->register_buffer("mask", t);
      else net->register_parameter("emb", t.to(torch::kFloat), /*requires_grad=*/false);
      try {
        cohort::torch::DistributedDataParallel ddp(net.ptr(), pgp);
      } catch (const cohort::InvalidArgument& e) {
        errs[pg.rank()] = e.what();
      }
    });
    const std::string want = buffer ? "buffer 'mask' is 'mask [4] Bool' on rank 0 but 'mask [5] Bool' on rank 1"
                                    : "frozen parameter 'emb' is 'emb [4] f32' on rank 0 but 'emb [5] f32' on rank 1";
    EXPECT_NE(errs[1].find(want), std::string::npos) << errs[1];
    const std::string kind = buffer ? "buffers" : "frozen parameters";
    EXPECT_NE(errs[0].find("ranks [1] have different " + kind + " than rank 0"), std::string::npos) << errs[0];
  }
}

// The same parameter trainable on one rank and frozen on another is a
// different model, not something to average.
TEST(DdpErrors, FrozenOnOneRankOnlyIsNamed) {
  std::vector<std::string> errs(2);
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    auto pgp = borrowed(pg);
    Net net;
    if (pg.rank() == 1) net->fc1->bias.set_requires_grad(false);
    try {
      cohort::torch::DistributedDataParallel ddp(net.ptr(), pgp);
    } catch (const cohort::InvalidArgument& e) {
      errs[pg.rank()] = e.what();
    }
  });
  for (auto& e : errs) EXPECT_NE(e.find("ranks [1] have different parameters"), std::string::npos) << e;
  EXPECT_NE(errs[1].find("rank 0 has a parameter 'fc1.bias [16] f32' that rank 1 does not have"), std::string::npos)
      << errs[1];
}

// A model with buffers and one extra layer on one rank: the message names
// the extra layer, not a buffer that merely moved up the list.
TEST(DdpErrors, AnExtraLayerIsNamedWhenTheModelHasBuffers) {
  std::vector<std::string> errs(2);
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    auto pgp = borrowed(pg);
    Net net(pg.rank() == 1);
    net->register_module("bn", torch::nn::BatchNorm1d(4));
    try {
      cohort::torch::DistributedDataParallel ddp(net.ptr(), pgp);
    } catch (const cohort::InvalidArgument& e) {
      errs[pg.rank()] = e.what();
    }
  });
  EXPECT_NE(errs[1].find("rank 1 has a parameter 'spare.weight [4, 4] f32' that rank 0 does not have"),
            std::string::npos)
      << errs[1];
  EXPECT_NE(errs[0].find("ranks [1] have different parameters than rank 0"), std::string::npos) << errs[0];
}

// The same layers registered in another order are named as such.
TEST(DdpErrors, AnotherRegistrationOrderIsNamed) {
  std::vector<std::string> errs(2);
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    auto pgp = borrowed(pg);
    auto m = std::make_shared<torch::nn::Module>();
    auto a = torch::zeros({3}), b = torch::zeros({3});
    m->register_parameter(pg.rank() == 0 ? "a" : "b", a);
    m->register_parameter(pg.rank() == 0 ? "b" : "a", b);
    try {
      cohort::torch::DistributedDataParallel ddp(m, pgp);
    } catch (const cohort::InvalidArgument& e) {
      errs[pg.rank()] = e.what();
    }
  });
  EXPECT_NE(errs[1].find("the parameters are registered in another order: #0 is 'a' on rank 0 but 'b' on rank 1"),
            std::string::npos)
      << errs[1];
}

// With gradient_as_bucket_view .grad is a view of a bucket: destroying the DDP
// object must leave the module with gradients it owns, not dangling views.
TEST(DdpErrors, GradientsOutliveTheDdpObject) {
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    auto pgp = borrowed(pg);
    Net net;
    std::vector<torch::Tensor> inside;
    std::vector<void*> views;
    {
      cohort::torch::DistributedDataParallel ddp(net.ptr(), pgp, ddp_options(/*bucket_view=*/true));
      ddp.pre_forward();
      torch::mse_loss(net->forward(inputs(pg.rank() * kLocal, kLocal)), targets(pg.rank() * kLocal, kLocal)).backward();
      inside = grads_of(*net);
      for (auto& p : net->parameters()) views.push_back(p.grad().data_ptr());
    }
    std::vector<torch::Tensor> after;
    for (auto& p : net->parameters()) after.push_back(p.grad());
    for (size_t i = 0; i < after.size(); ++i)
      EXPECT_NE(after[i].data_ptr(), views[i]) << "param " << i << " still points into the freed bucket";
    expect_close(after, inside, 1e-12, pg.rank());
  });
}

// A gradient that arrives undefined (a custom Function returns none for it)
// counts as zeros, as in PyTorch: not an error, and with gradient_as_bucket_view
// not the previous step's average left in the bucket.
struct NoGradForWeight : torch::autograd::Function<NoGradForWeight> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, torch::Tensor w) {
    ctx->save_for_backward({w});
    return x * w;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    return {g[0] * ctx->get_saved_variables()[0], torch::Tensor()};
  }
};
TEST(DdpErrors, UndefinedGradientsCountAsZeros) {
  for (bool bucket_view : {false, true}) {
    run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
      auto pgp = borrowed(pg);
      auto m = std::make_shared<torch::nn::Module>();
      auto w = m->register_parameter("w", torch::ones({3}));
      cohort::torch::DistributedDataParallel ddp(m, pgp, ddp_options(bucket_view));
      torch::optim::SGD opt({w}, torch::optim::SGDOptions(0.0));
      auto x = torch::ones({3}, torch::requires_grad());
      ddp.pre_forward();
      (w * (pg.rank() + 1.0)).sum().backward();  // a real gradient first: the average is 1.5
      EXPECT_TRUE(torch::allclose(w.grad(), torch::full({3}, 1.5)));
      cohort::torch::zero_grad(opt);
      ddp.pre_forward();
      NoGradForWeight::apply(x, w).sum().backward();
      ASSERT_TRUE(w.grad().defined()) << "rank " << pg.rank();
      EXPECT_TRUE(torch::equal(w.grad(), torch::zeros({3}))) << "rank " << pg.rank() << ": " << w.grad();
    });
  }
}

// A backward that fails under no_sync (the user skips that micro-batch) must
// not leave DDP unable to average the next synced backward.
TEST(DdpErrors, AFailedNoSyncBackwardDoesNotSkipTheNextAverage) {
  const auto want = reference_grads(kLocal * 2, 1);
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    auto pgp = borrowed(pg);
    Net net;
    cohort::torch::DistributedDataParallel ddp(net.ptr(), pgp);
    const int64_t from = pg.rank() * kLocal;
    {
      auto guard = ddp.no_sync();
      auto h = torch::tanh(net->fc1->forward(inputs(from, kLocal)));
      h.register_hook([](torch::Tensor) -> torch::Tensor { throw std::runtime_error("bad batch"); });
      EXPECT_THROW(torch::mse_loss(net->fc2->forward(h), targets(from, kLocal)).backward(), std::exception);
    }
    for (auto& p : net->parameters()) p.mutable_grad().reset();  // drop the half-done micro-batch
    torch::mse_loss(net->forward(inputs(from, kLocal)), targets(from, kLocal)).backward();
    expect_close(grads_of(*net), want, 1e-5, pg.rank());
  });
}

// Used on rank 0 only: every rank gets the average (rank 1 has no gradient of
// its own, but must take the same step).
TEST(DdpErrors, UsedOnOneRankOnlyIsAveragedEverywhere) {
  for (bool bucket_view : {false, true}) {
    run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
      auto pgp = borrowed(pg);
      Net net(/*with_unused=*/true);
      auto o = ddp_options(bucket_view);
      o.find_unused_parameters = true;
      cohort::torch::DistributedDataParallel ddp(net.ptr(), pgp, o);
      ddp.pre_forward();
      auto loss = torch::mse_loss(net->forward(inputs(0, kLocal)), targets(0, kLocal));
      if (pg.rank() == 0) loss = loss + net->spare->bias.sum();  // d/d bias = 1 on rank 0, nothing on rank 1
      loss.backward();
      ASSERT_TRUE(net->spare->bias.grad().defined()) << "rank " << pg.rank();
      EXPECT_TRUE(torch::allclose(net->spare->bias.grad(), torch::full({4}, 0.5))) << "rank " << pg.rank();
    });
  }
}

TEST(DdpErrors, SparseGradientsAreNamed) {
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    auto pgp = borrowed(pg);
    auto emb = torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 4).sparse(true));
    cohort::torch::DistributedDataParallel ddp(emb.ptr(), pgp);
    try {
      emb->forward(torch::tensor({1, 2}, torch::kLong)).sum().backward();
      ADD_FAILURE() << "a sparse gradient was accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("the gradient of 'weight' is sparse"), std::string::npos) << e.what();
    }
  });
}

TEST(TrainUtils, WarmupCosineAndClipping) {
  EXPECT_DOUBLE_EQ(cohort::torch::warmup_cosine_lr(0, 10, 110, 1.0), 0.1);
  EXPECT_DOUBLE_EQ(cohort::torch::warmup_cosine_lr(9, 10, 110, 1.0), 1.0);
  EXPECT_NEAR(cohort::torch::warmup_cosine_lr(60, 10, 110, 1.0), 0.5, 1e-12);
  EXPECT_NEAR(cohort::torch::warmup_cosine_lr(110, 10, 110, 1.0), 0.0, 1e-12);
  auto p = torch::ones({4}, torch::requires_grad());
  (p * 3).sum().backward();  // grad = 3 everywhere, norm 6
  EXPECT_NEAR(cohort::torch::clip_grad_norm({p}, 1.0), 6.0, 1e-9);
  EXPECT_NEAR(p.grad().norm().item<double>(), 1.0, 1e-5);
}

TEST(TrainUtils, GradScalerSkipsNonFiniteStepsAndBacksOff) {
  auto p = torch::ones({2}, torch::requires_grad());
  torch::optim::SGD opt({p}, torch::optim::SGDOptions(0.1));
  cohort::torch::GradScaler scaler({.init_scale = 1024, .growth_interval = 2});
  scaler.scale(p.sum()).backward();
  EXPECT_TRUE(scaler.step(opt, nullptr));
  EXPECT_NEAR(p[0].item<double>(), 0.9, 1e-6);  // unscaled gradient 1, lr 0.1
  opt.zero_grad();
  p.mutable_grad() = torch::full({2}, std::numeric_limits<float>::infinity());
  EXPECT_FALSE(scaler.step(opt, nullptr));
  EXPECT_NEAR(p[0].item<double>(), 0.9, 1e-6);  // skipped
  EXPECT_EQ(scaler.current_scale(), 512.0);
  EXPECT_EQ(scaler.skipped_steps(), 1);
  for (int i = 0; i < 2; ++i) {
    opt.zero_grad();
    scaler.scale(p.sum()).backward();
    EXPECT_TRUE(scaler.step(opt, nullptr));
  }
  EXPECT_EQ(scaler.current_scale(), 1024.0);  // grew after growth_interval clean steps
}

}  // namespace

namespace {

// A model with BatchNorm: its running statistics are buffers.
struct BnNetImpl : torch::nn::Module {
  BnNetImpl() {
    fc = register_module("fc", torch::nn::Linear(8, 4));
    bn = register_module("bn", torch::nn::BatchNorm1d(4));
    torch::NoGradGuard g;  // deterministic weights, as NetImpl's
    auto flat = fc->weight.view({-1});
    for (int64_t i = 0; i < flat.numel(); ++i) flat[i] = std::sin(0.37 * i) * 0.5;
    fc->bias.fill_(0.1);
  }
  torch::Tensor forward(torch::Tensor x) { return bn->forward(fc->forward(x)); }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(BnNet);

// broadcast_buffers: each pre_forward() copies rank 0's running statistics
// to every rank. Rank 0's evolve with its own batches only (as in one
// process that saw them), and after a pre_forward() every rank holds them;
// with broadcast_buffers off each rank keeps its own.
TEST(DdpBuffers, PreForwardBroadcastsRankZerosBuffers) {
  const auto batch = [](int rank, int step) { return inputs(rank * 16 + step * 100, 4) * (rank + 1); };
  BnNet alone;  // rank 0's three batches in one process
  for (int step = 0; step < 3; ++step) alone->forward(batch(0, step));
  const auto want = alone->bn->running_mean.clone();
  for (const bool broadcast : {true, false}) {
    run_ranks(3, "shm", [&](cohort::ProcessGroup& pg) {
      BnNet net;
      cohort::torch::DistributedDataParallelOptions o;
      o.broadcast_buffers = broadcast;
      cohort::torch::DistributedDataParallel ddp(net.ptr(), borrowed(pg), o);
      for (int step = 0; step < 3; ++step) {
        ddp.pre_forward();
        net->forward(batch(pg.rank(), step)).sum().backward();
      }
      if (pg.rank() == 0) {
        EXPECT_TRUE(torch::allclose(net->bn->running_mean, want));
      }
      ddp.pre_forward();
      std::vector<float> mine(4), all(4 * 3);
      std::memcpy(mine.data(), net->bn->running_mean.data_ptr<float>(), sizeof(float) * 4);
      pg.allgather(cohort::Buffer{mine.data(), 4, cohort::DType::F32},
                   cohort::Buffer{all.data(), all.size(), cohort::DType::F32})
          ->wait();
      for (int r = 1; r < 3; ++r) {
        bool same = std::equal(all.begin() + r * 4, all.begin() + r * 4 + 4, all.begin());
        EXPECT_EQ(same, broadcast) << "rank " << r << "'s running_mean against rank 0's, broadcast_buffers "
                                   << broadcast;
      }
    });
  }
}

// With buffers to broadcast, a program that never calls pre_forward() gets an
// error naming a buffer on its first synced backward, on every rank. Once it
// has called it, several backwards of one forward (retain_graph) and
// accumulation under no_sync are fine.
TEST(DdpBuffers, ForgettingPreForwardWithBuffersIsAnError) {
  std::vector<std::string> errs(2);
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    BnNet net;
    cohort::torch::DistributedDataParallel ddp(net.ptr(), borrowed(pg));
    auto x = inputs(pg.rank() * 4, 4);
    {
      auto guard = ddp.no_sync();  // not checked: nothing is reduced
      EXPECT_NO_THROW(net->forward(x).sum().backward());
    }
    try {
      net->forward(x).sum().backward();
    } catch (const std::exception& e) {
      errs[pg.rank()] = e.what();
    }
    ddp.pre_forward();
    {
      auto guard = ddp.no_sync();
      net->forward(x).sum().backward();
    }
    EXPECT_NO_THROW(net->forward(x).sum().backward());
    // Two losses of one forward, each reduced.
    ddp.pre_forward();
    auto out = net->forward(x);
    EXPECT_NO_THROW(out.sum().backward({}, /*retain_graph=*/true));
    EXPECT_NO_THROW(out.pow(2).sum().backward());
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errs[r].find("backward ran but pre_forward() was never called"), std::string::npos) << r << ": " << errs[r];
    EXPECT_NE(errs[r].find("'bn.running_mean'"), std::string::npos) << errs[r];
  }
}

// Without buffers, forgetting pre_forward() changes nothing: gradients are still averaged.
TEST(DdpBuffers, WithoutBuffersPreForwardIsOptional) {
  torch::set_num_threads(1);
  auto want = reference_grads(kLocal * 2, 1);
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    Net net;
    cohort::torch::DistributedDataParallel ddp(net.ptr(), borrowed(pg));
    int64_t from = pg.rank() * kLocal;
    torch::mse_loss(net->forward(inputs(from, kLocal)), targets(from, kLocal)).backward();
    expect_close(grads_of(*net), want, 1e-5, pg.rank());
  });
}

}  // namespace

namespace {

// unscale() then clipping sees the true gradients; step() does not divide again.
TEST(TrainUtils, GradScalerUnscaleThenClipThenStep) {
  auto p = torch::ones({4}, torch::requires_grad());
  torch::optim::SGD opt({p}, torch::optim::SGDOptions(1.0));
  cohort::torch::GradScaler scaler({.init_scale = 256});
  scaler.scale((p * 3).sum()).backward();  // true gradient 3 everywhere (norm 6), scaled 768
  EXPECT_TRUE(scaler.unscale(opt, nullptr));
  EXPECT_NEAR(p.grad()[0].item<double>(), 3.0, 1e-6);
  EXPECT_NEAR(cohort::torch::clip_grad_norm({p}, 1.0), 6.0, 1e-5);  // the true norm, not 256 times it
  EXPECT_THROW(scaler.unscale(opt, nullptr), cohort::InvalidArgument);  // twice would divide twice
  EXPECT_TRUE(scaler.step(opt, nullptr));
  EXPECT_NEAR(p[0].item<double>(), 1.0 - 0.5, 1e-5);  // clipped gradient 0.5 per element, lr 1
  // unscale() without step() is caught at the next scale(): the verdict would go stale.
  opt.zero_grad();
  scaler.scale((p * 2).sum()).backward();
  scaler.unscale(opt, nullptr);
  EXPECT_THROW(scaler.scale((p * 2).sum()), cohort::InvalidArgument);
  EXPECT_TRUE(scaler.step(opt, nullptr));
  EXPECT_NEAR(p[0].item<double>(), 0.5 - 2.0, 1e-5);
  // The next step unscales by itself again.
  opt.zero_grad();
  scaler.scale((p * 2).sum()).backward();
  EXPECT_TRUE(scaler.step(opt, nullptr));
  EXPECT_NEAR(p[0].item<double>(), 0.5 - 4.0, 1e-5);
}

TEST(TrainUtils, GradScalerRefusesOptionsThatCannotWork) {
  EXPECT_THROW(cohort::torch::GradScaler({.init_scale = 0}), cohort::InvalidArgument);
  EXPECT_THROW(cohort::torch::GradScaler({.growth_factor = 1.0}), cohort::InvalidArgument);
  EXPECT_THROW(cohort::torch::GradScaler({.backoff_factor = 1.5}), cohort::InvalidArgument);
  EXPECT_THROW(cohort::torch::GradScaler({.growth_interval = 0}), cohort::InvalidArgument);
}

// An inf on one rank only: every rank skips the step and backs off together,
// so the replicas stay equal.
TEST(TrainUtils, GradScalerSkipsOnEveryRankWhenOneRankOverflows) {
  std::vector<double> scales(3), values(3);
  std::vector<int> stepped(3);
  run_ranks(3, "shm", [&](cohort::ProcessGroup& pg) {
    auto p = torch::ones({2}, torch::requires_grad());
    torch::optim::SGD opt({p}, torch::optim::SGDOptions(0.1));
    cohort::torch::GradScaler scaler({.init_scale = 1024});
    scaler.scale(p.sum()).backward();
    if (pg.rank() == 1) p.mutable_grad()[0] = std::numeric_limits<float>::infinity();
    stepped[pg.rank()] = scaler.step(opt, &pg);
    scales[pg.rank()] = scaler.current_scale();
    values[pg.rank()] = p[1].item<double>();
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(stepped[r], 0) << "rank " << r;
    EXPECT_EQ(scales[r], 512.0) << "rank " << r;
    EXPECT_EQ(values[r], 1.0) << "rank " << r;
  }
}

// Inside the scope matmuls run in bf16; leaving it (also by an exception)
// restores the previous state; nested scopes restore the outer one.
TEST(TrainUtils, AutocastScopeRunsBf16AndRestores) {
  torch::nn::Linear fc(8, 4);
  auto x = torch::randn({2, 8});
  ASSERT_FALSE(cohort::torch::autocast_enabled(c10::DeviceType::CPU));
  {
    cohort::torch::Autocast autocast;
    EXPECT_EQ(fc->forward(x).scalar_type(), torch::kBFloat16);
    {
      cohort::torch::Autocast off(torch::kBFloat16, /*enabled=*/false);
      EXPECT_EQ(fc->forward(x).scalar_type(), torch::kFloat);
    }
    EXPECT_TRUE(cohort::torch::autocast_enabled(c10::DeviceType::CPU));
    EXPECT_EQ(fc->forward(x).scalar_type(), torch::kBFloat16);
  }
  EXPECT_FALSE(cohort::torch::autocast_enabled(c10::DeviceType::CPU));
  EXPECT_EQ(fc->forward(x).scalar_type(), torch::kFloat);
  try {
    cohort::torch::Autocast autocast;
    throw std::runtime_error("forward failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_FALSE(cohort::torch::autocast_enabled(c10::DeviceType::CPU));
  EXPECT_THROW(cohort::torch::Autocast(torch::kHalf), cohort::InvalidArgument);
  EXPECT_FALSE(cohort::torch::autocast_enabled(c10::DeviceType::CPU));
}

}  // namespace
