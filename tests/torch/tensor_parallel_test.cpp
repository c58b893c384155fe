// Tensor-parallel layers: at tp 2 and 4 each layer computes what the
// unsharded layer computes, forward and backward, each rank's weight gradient
// is its slice of the full gradient, the vocabulary-parallel loss equals
// cross-entropy on the full logits, sequence parallelism changes nothing but
// where the activations live, and a size that does not split is named. Ranks
// run as threads over a MemoryStore.
#include <gtest/gtest.h>

#include <mutex>

#include "cohort/torch.hpp"
#include "cohort/torch_train.hpp"
#include "cohort/torch_tensor_parallel.hpp"
#include "test_util.hpp"

namespace {

namespace tp = cohort::torch::tp;
using cohort::ProcessGroup;
using cohort::testing::run_ranks;
using torch::Tensor;

std::shared_ptr<ProcessGroup> borrow(ProcessGroup& pg) { return {&pg, [](ProcessGroup*) {}}; }

// The same numbers on every thread-rank, from a generator of their own.
Tensor seeded(std::vector<int64_t> shape, uint64_t seed, double scale = 0.5) {
  auto gen = at::detail::createCPUGenerator(seed);
  return torch::empty(shape).uniform_(-scale, scale, gen);
}
tp::LinearInit seeded_init(uint64_t seed) {
  return [seed](Tensor& w, Tensor& b) {
    w.copy_(seeded(w.sizes().vec(), seed));
    if (b.defined()) b.copy_(seeded(b.sizes().vec(), seed + 1));
  };
}

// Float32, summed in another order: the largest difference relative to the
// largest element (elementwise, a difference of a few ulps on an element near
// zero would read as a large relative error).
void expect_close(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double err = (got - want).abs().max().item<double>() / want.abs().max().clamp_min(1e-12).item<double>();
  EXPECT_LT(err, 1e-5) << what << ": largest difference relative to the largest element " << err;
}

// An MLP block h -> 4h -> h, column- then row-parallel, against the same
// weights unsharded; sequence_parallel splits the tokens (dimension 1).
void check_mlp(ProcessGroup& pg, bool sequence_parallel) {
  const int64_t B = 3, T = 4, C = 8, H = 16;
  const int r = pg.rank(), n = pg.size();
  auto group = borrow(pg);
  tp::ColumnParallelLinear fc1(group, C, H, {.sequence_parallel = sequence_parallel, .init = seeded_init(1)});
  tp::RowParallelLinear fc2(group, H, C, {.sequence_parallel = sequence_parallel, .init = seeded_init(3)});

  // The unsharded reference, with leaf copies of the full weights.
  Tensor w1 = seeded({H, C}, 1).requires_grad_(), b1 = seeded({H}, 2).requires_grad_();
  Tensor w2 = seeded({C, H}, 3).requires_grad_(), b2 = seeded({C}, 4).requires_grad_();
  Tensor x_full = seeded({B, T, C}, 7).requires_grad_();
  Tensor probe = seeded({B, T, C}, 9);
  Tensor y_full = torch::nn::functional::linear(torch::gelu(torch::nn::functional::linear(x_full, w1, b1)), w2, b2);
  (y_full * probe).sum().backward();

  Tensor x = sequence_parallel ? x_full.detach().chunk(n, 1)[r].clone() : x_full.detach().clone();
  x.requires_grad_();
  Tensor y = fc2->forward(torch::gelu(fc1->forward(x)));
  Tensor my_probe = sequence_parallel ? probe.chunk(n, 1)[r] : probe;
  (y * my_probe).sum().backward();
  if (sequence_parallel) tp::sync_sequence_parallel_grads(*fc2, pg);

  expect_close(y.detach(), sequence_parallel ? y_full.detach().chunk(n, 1)[r] : y_full.detach(), "output");
  expect_close(x.grad(), sequence_parallel ? x_full.grad().chunk(n, 1)[r] : x_full.grad(), "input gradient");
  expect_close(fc1->weight.grad(), w1.grad().chunk(n, 0)[r], "fc1 weight gradient");
  expect_close(fc1->bias.grad(), b1.grad().chunk(n, 0)[r], "fc1 bias gradient");
  expect_close(fc2->weight.grad(), w2.grad().chunk(n, 1)[r], "fc2 weight gradient");
  expect_close(fc2->bias.grad(), b2.grad(), "fc2 bias gradient (replicated)");
}

TEST(TensorParallel, MlpEqualsTheUnshardedBlock) {
  for (int n : {2, 4}) run_ranks(n, "", [](ProcessGroup& pg) { check_mlp(pg, false); });
}

TEST(TensorParallel, SequenceParallelMlpEqualsTheUnshardedBlock) {
  for (int n : {2, 4}) run_ranks(n, "", [](ProcessGroup& pg) { check_mlp(pg, true); });
}

// A fused q|k|v projection: rank r holds part r of each of the three blocks.
TEST(TensorParallel, FusedColumnBlocksKeepEachBlocksPart) {
  run_ranks(2, "", [](ProcessGroup& pg) {
    const int r = pg.rank();
    tp::ColumnParallelLinear qkv(borrow(pg), 4, 12, {.blocks = 3, .init = seeded_init(5)});
    const Tensor w = seeded({12, 4}, 5);
    for (int blk = 0; blk < 3; ++blk)
      expect_close(qkv->weight.narrow(0, blk * 2, 2).detach(), w.narrow(0, blk * 4 + r * 2, 2), "block weight");
  });
}

TEST(TensorParallel, GatheredColumnOutputAndSplitRowInputEqualLinear) {
  run_ranks(2, "", [](ProcessGroup& pg) {
    tp::ColumnParallelLinear col(borrow(pg), 6, 4, {.gather_output = true, .init = seeded_init(11)});
    tp::RowParallelLinear row(borrow(pg), 4, 6, {.input_is_parallel = false, .init = seeded_init(13)});
    const Tensor x = seeded({5, 6}, 15);
    const Tensor h = col->forward(x);
    expect_close(h.detach(), torch::nn::functional::linear(x, seeded({4, 6}, 11), seeded({4}, 12)), "column output");
    expect_close(row->forward(h).detach(),
                 torch::nn::functional::linear(h.detach(), seeded({6, 4}, 13), seeded({6}, 14)), "row output");
  });
}

TEST(TensorParallel, DefaultInitialisationIsTheUnshardedLinears) {
  static std::mutex mu;  // LibTorch's global generator, seeded alike for each thread-rank's layer
  run_ranks(2, "", [](ProcessGroup& pg) {
    Tensor weight, want;
    {
      std::lock_guard lock(mu);
      torch::manual_seed(42);
      tp::ColumnParallelLinear col(borrow(pg), 6, 4);
      weight = col->weight.detach();
      torch::manual_seed(42);
      want = torch::nn::Linear(6, 4)->weight.detach();
    }
    expect_close(weight, want.chunk(2, 0)[pg.rank()], "column weight");
  });
}

TEST(TensorParallel, VocabParallelEmbeddingAndCrossEntropyEqualTheFullVocabulary) {
  for (int n : {2, 4}) {
    run_ranks(n, "", [](ProcessGroup& pg) {
      const int64_t V = 16, D = 6, N = 10;
      const int r = pg.rank(), world = pg.size();
      auto table = [](Tensor& w) { w.copy_(seeded(w.sizes().vec(), 21)); };
      tp::VocabParallelEmbedding emb(borrow(pg), V, D, {.init = table});
      const Tensor ids = torch::arange(N) * 7 % V;
      Tensor full_table = seeded({V, D}, 21).requires_grad_();
      const Tensor probe = seeded({N, D}, 23);
      const Tensor want = torch::embedding(full_table, ids);
      (want * probe).sum().backward();
      const Tensor got = emb->forward(ids);
      (got * probe).sum().backward();
      expect_close(got.detach(), want.detach(), "embedding");
      expect_close(emb->weight.grad(), full_table.grad().chunk(world, 0)[r], "embedding gradient");

      // Logits large enough that a naive exp() would overflow in float.
      Tensor logits = (seeded({N, V}, 25) * 200).requires_grad_();
      const Tensor targets = (torch::arange(N) * 5 + 3) % V;
      const Tensor ref = torch::nn::functional::cross_entropy(
          logits, targets, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
      (ref * torch::arange(1, N + 1)).sum().backward();
      Tensor mine = logits.detach().chunk(world, 1)[r].clone().requires_grad_();
      const Tensor loss = tp::vocab_parallel_cross_entropy(mine, targets, pg);
      (loss * torch::arange(1, N + 1)).sum().backward();
      expect_close(loss.detach(), ref.detach(), "loss");
      expect_close(mine.grad(), logits.grad().chunk(world, 1)[r], "logit gradient");
    });
  }
}

TEST(TensorParallel, ClipGradNormIsTheGlobalNorm) {
  run_ranks(2, "", [](ProcessGroup& pg) {
    torch::nn::Sequential net;
    tp::ColumnParallelLinear fc1(borrow(pg), 4, 6, {.init = seeded_init(31)});
    tp::RowParallelLinear fc2(borrow(pg), 6, 4, {.init = seeded_init(33)});
    net->push_back(fc1);
    net->push_back(torch::nn::Functional(torch::tanh));
    net->push_back(fc2);
    Tensor w1 = seeded({6, 4}, 31).requires_grad_(), b1 = seeded({6}, 32).requires_grad_();
    Tensor w2 = seeded({4, 6}, 33).requires_grad_(), b2 = seeded({4}, 34).requires_grad_();
    const Tensor x = seeded({3, 4}, 35);
    torch::nn::functional::linear(torch::tanh(torch::nn::functional::linear(x, w1, b1)), w2, b2).pow(2).sum().backward();
    net->forward(x).pow(2).sum().backward();
    double want = 0;
    for (const Tensor& p : {w1, b1, w2, b2}) want += p.grad().pow(2).sum().item<double>();
    want = std::sqrt(want);
    const auto split = tp::split_parameters(*net);
    EXPECT_EQ(split.sharded.size(), 3u);     // fc1 weight and bias, fc2 weight
    EXPECT_EQ(split.replicated.size(), 1u);  // fc2 bias
    const double norm = tp::clip_grad_norm(*net, want / 2, pg, pg.rank());
    EXPECT_NEAR(norm, want, 1e-5 * want);
    const double after = std::sqrt(cohort::torch::allreduce_scalar(pg, fc1->weight.grad().pow(2).sum().template item<double>()));
    EXPECT_NEAR(after / std::sqrt(w1.grad().pow(2).sum().item<double>()), 0.5, 1e-5);
  });
}

// The replicated stream draws the same masks on every rank of the group, the
// parallel one its own: an MLP with dropout on its split hidden layer and on
// its replicated output leaves both ranks with the same output.
TEST(TensorParallel, DropoutKeepsReplicasEqualAndSplitsDrawTheirOwn) {
  run_ranks(2, "", [](ProcessGroup& pg) {
    tp::DropoutRng rng(7, pg, /*replica=*/3);
    auto gathered = [&](const Tensor& t) { return tp::gather(t.unsqueeze(0), pg, 0); };  // [2, ...]
    const Tensor same = gathered(torch::rand({64}, rng.replicated()));
    const Tensor own = gathered(torch::rand({64}, rng.parallel()));
    EXPECT_TRUE(torch::equal(same[0], same[1]));
    EXPECT_FALSE(torch::equal(own[0], own[1]));
    tp::DropoutRng other(7, pg, /*replica=*/4);
    EXPECT_FALSE(torch::equal(torch::rand({64}, other.replicated()), same[0])) << "another replica, another mask";

    tp::ColumnParallelLinear fc1(borrow(pg), 8, 16, {.init = seeded_init(41)});
    tp::RowParallelLinear fc2(borrow(pg), 16, 8, {.init = seeded_init(43)});
    const Tensor x = seeded({32, 8}, 45);
    const Tensor h = tp::dropout(torch::gelu(fc1->forward(x)), 0.3, rng.parallel(), true);
    const Tensor y = tp::dropout(fc2->forward(h), 0.3, rng.replicated(), true);
    const Tensor both = gathered(y.detach());
    EXPECT_TRUE(torch::equal(both[0], both[1])) << "the replicas of the output drifted apart";
    const double zeros = (y == 0).to(torch::kDouble).mean().item<double>();
    EXPECT_GT(zeros, 0.2);
    EXPECT_LT(zeros, 0.4);
    EXPECT_TRUE(torch::equal(tp::dropout(x, 0.3, rng.parallel(), /*training=*/false), x));
    EXPECT_THROW(tp::dropout(x, 1.0, rng.parallel(), true), cohort::InvalidArgument);
  });
}

// Full state round trip at tp 3 (a fused q|k|v layer), and states that do not
// fit are named, never sliced past their end.
TEST(TensorParallel, FullStateRoundTripsAndAWrongStateIsNamed) {
  run_ranks(3, "", [](ProcessGroup& pg) {
    torch::nn::Sequential net;
    net->push_back(tp::ColumnParallelLinear(borrow(pg), 4, 18, {.blocks = 3, .init = seeded_init(51)}));
    const auto full = tp::full_module_state(*net);
    ASSERT_EQ(full.size(), 2u);
    EXPECT_EQ(full[0].shape, (std::vector<int64_t>{18, 4}));
    expect_close(cohort::torch::from_named(full[0]), seeded({18, 4}, 51), "gathered weight");
    torch::nn::Sequential again;
    again->push_back(tp::ColumnParallelLinear(borrow(pg), 4, 18, {.blocks = 3, .init = seeded_init(99)}));
    tp::load_full_module_state(*again, full);
    expect_close(again->parameters()[0].detach(), net->parameters()[0].detach(), "reloaded slice");
    auto wrong = full;
    wrong[0] = cohort::torch::to_named(full[0].name, torch::zeros({6, 4}));  // a smaller model's
    try {
      tp::load_full_module_state(*again, wrong);
      ADD_FAILURE() << "loaded a [6, 4] state into an [18, 4] layer";
    } catch (const cohort::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("\"0.weight\" is [6, 4] in the state"), std::string::npos) << e.what();
    }
    // Targets the vocabulary does not have, or of the wrong type, are named.
    const Tensor logits = torch::zeros({2, 4});
    EXPECT_THROW(tp::vocab_parallel_cross_entropy(logits, torch::tensor({0, 12}, torch::kLong), pg), cohort::InvalidArgument);
    EXPECT_THROW(tp::vocab_parallel_cross_entropy(logits, torch::tensor({0, -100}, torch::kLong), pg), cohort::InvalidArgument);
    EXPECT_THROW(tp::vocab_parallel_cross_entropy(logits, torch::tensor({0, 1}, torch::kInt), pg), cohort::InvalidArgument);
  });
}

TEST(TensorParallel, SizesThatDoNotSplitAreNamed) {
  run_ranks(4, "", [](ProcessGroup& pg) {
    auto g = borrow(pg);
    try {
      tp::ColumnParallelLinear(g, 8, 10);
      ADD_FAILURE() << "10 columns split 4 ways";
    } catch (const cohort::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("out_features 10 does not divide by the tensor-parallel degree 4"),
                std::string::npos)
          << e.what();
    }
    EXPECT_THROW(tp::RowParallelLinear(g, 6, 8), cohort::InvalidArgument);
    EXPECT_THROW(tp::VocabParallelEmbedding(g, 10, 8), cohort::InvalidArgument);
    EXPECT_THROW(tp::ColumnParallelLinear(g, 8, 18, {.blocks = 3}), cohort::InvalidArgument);  // 6 per block
    EXPECT_THROW(tp::ColumnParallelLinear(nullptr, 8, 8), cohort::InvalidArgument);
  });
}

}  // namespace
