// A small decoder-only transformer (GPT-2's layout: pre-norm blocks of causal
// self-attention and a 4x MLP, learned position embeddings, dropout off by
// default) whose
// matrices are split across a tensor-parallel group with cohort's layers:
//
//   ids ─> VocabParallelEmbedding + positions ─> block x L ─> LayerNorm ─> head ─> vocab-parallel loss
//   block: x + proj(attention(qkv(ln1(x))))   qkv column-parallel (heads split), proj row-parallel
//          x + fc2(gelu(fc1(ln2(x))))          fc1 column-parallel, fc2 row-parallel
//   head:  column-parallel over the vocabulary: no rank holds the full logits.
//
// Every weight is drawn from a generator seeded by the model seed and the
// weight's place in the model (layer, matrix), so the model built at any
// tensor-parallel degree holds slices of the same weights as the one built in
// one process: the equivalence tests compare them directly.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>

#include "cohort/torch_recompute.hpp"
#include "cohort/torch_tensor_parallel.hpp"

namespace gpt {

namespace tp = cohort::torch::tp;

struct Config {
  int64_t vocab = 256;   // bytes
  int64_t context = 64;  // tokens per sequence
  int64_t dim = 128;
  int64_t heads = 4;
  int64_t layers = 4;
  bool sequence_parallel = false;
  bool recompute = false;  // keep each block's input only, run the block again in backward
  double dropout = 0.0;  // on the embedding, the attention probabilities and each residual branch
  uint64_t seed = 1234;
  int64_t params() const {  // of the whole (unsharded) model
    const int64_t block = 2 * 2 * dim + (3 * dim * dim + 3 * dim) + (dim * dim + dim) + (4 * dim * dim + 4 * dim) +
                          (4 * dim * dim + dim);
    return vocab * dim + context * dim + layers * block + 2 * dim + dim * vocab;
  }
};

// Normal(0, std) from a generator of the weight's own (seed, slot).
inline torch::Tensor draw(std::vector<int64_t> shape, uint64_t seed, uint64_t slot, double std) {
  auto gen = at::detail::createCPUGenerator(seed * 1000003ULL + slot);
  return torch::empty(shape).normal_(0.0, std, gen);
}

// GPT-2's initialisation: N(0, 0.02), residual projections N(0, 0.02 / sqrt(2L)), biases 0.
inline tp::LinearInit init_linear(const Config& c, uint64_t slot, bool residual = false) {
  const double std = residual ? 0.02 / std::sqrt(2.0 * c.layers) : 0.02;
  return [c, slot, std](torch::Tensor& w, torch::Tensor& b) {
    w.copy_(draw(w.sizes().vec(), c.seed, slot, std));
    if (b.defined()) b.zero_();
  };
}

struct BlockImpl : torch::nn::Module {
  BlockImpl(const Config& c, std::shared_ptr<cohort::ProcessGroup> group, int64_t layer,
            std::shared_ptr<tp::DropoutRng> rng_)
      : cfg(c), tp_size(group->size()), rng(std::move(rng_)) {
    const uint64_t slot = 16 * (layer + 1);
    const bool sp = c.sequence_parallel;
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    qkv = register_module("qkv", tp::ColumnParallelLinear(group, c.dim, 3 * c.dim,
                                                          {.sequence_parallel = sp, .blocks = 3, .init = init_linear(c, slot)}));
    proj = register_module("proj", tp::RowParallelLinear(group, c.dim, c.dim,
                                                         {.sequence_parallel = sp, .init = init_linear(c, slot + 1, true)}));
    fc1 = register_module("fc1", tp::ColumnParallelLinear(group, c.dim, 4 * c.dim,
                                                          {.sequence_parallel = sp, .init = init_linear(c, slot + 2)}));
    fc2 = register_module("fc2", tp::RowParallelLinear(group, 4 * c.dim, c.dim,
                                                       {.sequence_parallel = sp, .init = init_linear(c, slot + 3, true)}));
  }

  // x: [batch, tokens (this rank's part with sequence parallelism), dim]
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t heads = cfg.heads / tp_size, hd = cfg.dim / cfg.heads;
    torch::Tensor h = qkv->forward(ln1->forward(x));  // [B, T, 3 * dim / tp]: this rank's heads
    const int64_t B = h.size(0), T = h.size(1);
    auto qkv_parts = h.chunk(3, -1);
    auto heads_of = [&](const torch::Tensor& t) { return t.reshape({B, T, heads, hd}).transpose(1, 2); };
    const torch::Tensor q = heads_of(qkv_parts[0]), k = heads_of(qkv_parts[1]), v = heads_of(qkv_parts[2]);
    torch::Tensor att = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    const torch::Tensor future = torch::ones({T, T}, torch::dtype(torch::kBool).device(x.device())).triu(1);
    att = torch::softmax(att.masked_fill(future, -std::numeric_limits<double>::infinity()), -1);
    att = tp::dropout(att, cfg.dropout, rng->parallel(), is_training());  // this rank's heads
    const torch::Tensor y = torch::matmul(att, v).transpose(1, 2).reshape({B, T, heads * hd});
    torch::Tensor out = x + residual_dropout(proj->forward(y));
    return out + residual_dropout(fc2->forward(torch::gelu(fc1->forward(ln2->forward(out)))));
  }

  // The residual stream is replicated over the tp group (the same mask on
  // every rank), or split along the tokens with sequence parallelism.
  torch::Tensor residual_dropout(const torch::Tensor& x) {
    return tp::dropout(x, cfg.dropout, cfg.sequence_parallel ? rng->parallel() : rng->replicated(), is_training());
  }

  Config cfg;
  int64_t tp_size;
  std::shared_ptr<tp::DropoutRng> rng;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  tp::ColumnParallelLinear qkv{nullptr}, fc1{nullptr};
  tp::RowParallelLinear proj{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

// A run of the model: the embedding (on the first stage), blocks [first,
// last), the final norm and the head (on the last stage). The whole model is
// the one stage that holds everything; a pipeline gives each virtual stage
// its part. Parameter names are the whole model's ("block7.fc1.weight"), so
// the stages' states together are the whole model's state. With sequence
// parallelism the embedding's output is split along the tokens (dimension 1)
// and the head gathers it back.
struct StageImpl : torch::nn::Module {
  // `replica` tells the dropout streams of data-parallel replicas and
  // pipeline stages apart (tp::DropoutRng).
  StageImpl(const Config& c, std::shared_ptr<cohort::ProcessGroup> group, int64_t first, int64_t last, bool embed,
            bool with_head, uint64_t replica = 0)
      : cfg(c), tp_group(group), rng(std::make_shared<tp::DropoutRng>(c.seed, *group, replica)) {
    check(c, group->size());
    const bool sp = c.sequence_parallel;
    if (embed) {
      tok = register_module("tok", tp::VocabParallelEmbedding(group, c.vocab, c.dim,
                                                              {.sequence_parallel = sp, .init = [c](torch::Tensor& w) {
                                                                 w.copy_(draw(w.sizes().vec(), c.seed, 1, 0.02));
                                                               }}));
      pos = register_parameter("pos", draw({c.context, c.dim}, c.seed, 2, 0.01));
    }
    for (int64_t l = first; l < last; ++l) blocks.push_back(register_module("block" + std::to_string(l), Block(c, group, l, rng)));
    if (with_head) {
      ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
      head = register_module("head", tp::ColumnParallelLinear(group, c.dim, c.vocab,
                                                              {.bias = false, .sequence_parallel = sp, .init = init_linear(c, 3)}));
    }
  }

  // Names what does not split before any weight is built.
  static void check(const Config& c, int64_t tp) {
    auto need = [](bool ok, const std::string& what) {
      if (!ok) throw cohort::InvalidArgument(what);
    };
    need(c.dim % c.heads == 0, "gpt: --dim " + std::to_string(c.dim) + " does not divide by --heads " + std::to_string(c.heads));
    need(c.heads % tp == 0, "gpt: --heads " + std::to_string(c.heads) + " does not divide by the tensor-parallel degree " +
                                std::to_string(tp) + "; choose --tp among the divisors of the head count");
    need(c.vocab % tp == 0, "gpt: the vocabulary (" + std::to_string(c.vocab) +
                                ") does not divide by the tensor-parallel degree " + std::to_string(tp));
    need(c.dropout >= 0 && c.dropout < 1, "gpt: --dropout " + std::to_string(c.dropout) + " is outside [0, 1)");
    need(!c.sequence_parallel || c.context % tp == 0,
         "gpt: with sequence parallelism --context " + std::to_string(c.context) + " must divide by --tp " + std::to_string(tp));
  }

  // ids [B, T] on the first stage, else the hidden state [B, T (/ tp), dim];
  // returns the hidden state, or on the last stage this rank's logits [B, T, vocab / tp].
  torch::Tensor forward(const torch::Tensor& in) {
    torch::Tensor x = in;
    if (tok) {
      x = tok->forward(in);
      torch::Tensor p = pos.narrow(0, 0, in.size(1));
      if (cfg.sequence_parallel) p = p.chunk(tp_group->size(), 0)[tp_group->rank()];
      x = tp::dropout(x + p, cfg.dropout, cfg.sequence_parallel ? rng->parallel() : rng->replicated(), is_training());
    }
    for (auto& b : blocks) {
      if (!cfg.recompute) {
        x = b->forward(x);
        continue;
      }
      // The block's tp collectives run again in backward, and its dropout draws the same masks.
      x = cohort::torch::recompute([b](const torch::Tensor& t) mutable { return b->forward(t); }, x,
                                   {rng->replicated(), rng->parallel()});
    }
    return head ? head->forward(ln_f->forward(x)) : x;
  }

  // The mean next-token loss of this rank's logits against targets [B, T].
  torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& targets) {
    return tp::vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}), *tp_group).mean();
  }

  Config cfg;
  std::shared_ptr<cohort::ProcessGroup> tp_group;
  std::shared_ptr<tp::DropoutRng> rng;
  tp::VocabParallelEmbedding tok{nullptr};
  torch::Tensor pos;
  std::vector<Block> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  tp::ColumnParallelLinear head{nullptr};
};
TORCH_MODULE(Stage);

// The whole model in one stage.
inline Stage whole_model(const Config& c, std::shared_ptr<cohort::ProcessGroup> tp_group) {
  return Stage(c, std::move(tp_group), 0, c.layers, true, true);
}

}  // namespace gpt
