// examples/gpt: a small character-level GPT trained with tensor and data
// parallelism (docs/parallelism.md).
//
//   cohort run --nproc-per-node 4 build/gpt --tp 2 --dp 2 --epochs 1
//
// The world is a cohort::Mesh of dp x tp ranks (tp innermost, so a tp group
// stays inside a node). The model's matrices are split over the tp group
// (examples/gpt/model.hpp); DistributedDataParallel averages the gradients of
// each slice over the dp group. Every rank draws the same global batch of
// windows of the text and takes its dp slice, so any layout trains on the
// tokens one process would. Prints the loss, the validation loss per epoch and
// the tokens/s; --save writes the full (unsharded) model as a cohort
// checkpoint, which --load reads at any layout.
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "cohort/checkpoint.hpp"
#include "cohort/mesh.hpp"
#include "cohort/torch.hpp"
#include "cohort/torch_train.hpp"
#include "data.hpp"
#include "model.hpp"

namespace {

struct Args {
  int tp = 1, dp = 0;  // dp 0: the world size / tp
  gpt::Config model;
  int64_t batch = 32;  // sequences per step, over all dp ranks
  int64_t epochs = 1, epoch_steps = 0, max_steps = 0;
  double lr = 2e-3, clip = 1.0;
  int64_t warmup = 50;
  std::string dtype = "f32", data = "/usr/share/games/fortunes", save, load;
  int64_t val_seqs = 256, print_every = 50, timing_warmup = 5;
};

void parse(CLI::App& app, Args& a) {
  app.add_option("--tp", a.tp, "tensor-parallel degree (divides --heads)")->check(CLI::PositiveNumber);
  app.add_option("--dp", a.dp, "data-parallel degree (default: world size / tp)")->check(CLI::NonNegativeNumber);
  app.add_option("--layers", a.model.layers, "transformer blocks")->check(CLI::PositiveNumber);
  app.add_option("--dim", a.model.dim, "model width")->check(CLI::PositiveNumber);
  app.add_option("--heads", a.model.heads, "attention heads")->check(CLI::PositiveNumber);
  app.add_option("--context", a.model.context, "tokens per sequence")->check(CLI::PositiveNumber);
  app.add_flag("--sequence-parallel", a.model.sequence_parallel, "split the activations between blocks along the sequence");
  app.add_option("--seed", a.model.seed, "weights and batches");
  app.add_option("--batch", a.batch, "sequences per step over all data-parallel ranks")->check(CLI::PositiveNumber);
  app.add_option("--epochs", a.epochs, "epochs (an epoch: --epoch-steps steps)")->check(CLI::PositiveNumber);
  app.add_option("--epoch-steps", a.epoch_steps, "steps per epoch (default: the training text's tokens once)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-steps", a.max_steps, "stop after this many steps (0: run every epoch)")->check(CLI::NonNegativeNumber);
  app.add_option("--lr", a.lr, "peak learning rate (AdamW, warmup then cosine)")->check(CLI::PositiveNumber);
  app.add_option("--warmup", a.warmup, "warmup steps")->check(CLI::NonNegativeNumber);
  app.add_option("--clip", a.clip, "clip the global gradient norm (0: off)")->check(CLI::NonNegativeNumber);
  app.add_option("--dtype", a.dtype, "f32 or f64")->check(CLI::IsMember({"f32", "f64"}));
  app.add_option("--data", a.data, "directory of text files (default: Debian's fortunes)");
  app.add_option("--val-seqs", a.val_seqs, "validation sequences")->check(CLI::PositiveNumber);
  app.add_option("--print-every", a.print_every, "print the loss every N steps (1: every step, full precision)")
      ->check(CLI::PositiveNumber);
  app.add_option("--save", a.save, "checkpoint directory: the full model after every epoch");
  app.add_option("--load", a.load, "start from the newest checkpoint in this directory (any layout)");
}

int64_t local_params(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

struct Trainer {
  Args a;
  std::shared_ptr<cohort::ProcessGroup> world;
  cohort::Mesh mesh;
  gpt::Corpus corpus;
  gpt::Gpt model;
  std::unique_ptr<cohort::torch::DistributedDataParallel> ddp;
  std::unique_ptr<torch::optim::AdamW> opt;
  int64_t step = 0, total_steps = 0;
  bool lead;

  Trainer(Args args, std::shared_ptr<cohort::ProcessGroup> w)
      : a(std::move(args)),
        world(w),
        mesh(w, {.dp = a.dp ? a.dp : std::max(1, w->size() / a.tp), .tp = a.tp, .pp = 1}),
        corpus(gpt::load_corpus(a.data)),
        model(a.model, mesh.group_ptr(cohort::MeshDim::tp)),
        lead(w->rank() == 0) {
    if (a.batch % mesh.shape().dp != 0)
      throw cohort::InvalidArgument("gpt: --batch " + std::to_string(a.batch) + " does not divide by --dp " +
                                    std::to_string(mesh.shape().dp));
    if (a.dtype == "f64") model->to(torch::kDouble);
    if (!a.load.empty()) load();
    ddp = std::make_unique<cohort::torch::DistributedDataParallel>(model.ptr(), mesh.group_ptr(cohort::MeshDim::dp));
    opt = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(a.lr).weight_decay(0.0));
    if (a.epoch_steps == 0) a.epoch_steps = std::max<int64_t>(1, corpus.train.size(0) / (a.batch * a.model.context));
    total_steps = a.epochs * a.epoch_steps;
    if (a.max_steps > 0) total_steps = std::min(total_steps, a.max_steps);
  }

  void load() {
    auto ck = cohort::load_latest_valid(a.load);
    if (!ck) throw cohort::InvalidArgument("gpt: --load " + a.load + " holds no valid checkpoint");
    cohort::torch::tp::load_full_module_state(*model, ck->files.at("model"));
    step = ck->step;
    if (lead) std::printf("loaded %s (step %lld)\n", ck->path.c_str(), static_cast<long long>(step));
  }

  void save() {
    auto state = cohort::torch::tp::full_module_state(*model);  // collective over tp
    if (lead) {
      cohort::Manifest m;
      m.world_size = world->size();
      m.config = "{\"model\":\"gpt\"}";
      std::printf("saved %s\n", cohort::save_checkpoint(a.save, step, {{"model", state}}, m, {.keep_last = 2}).c_str());
    }
    world->barrier()->wait();
  }

  double train_step() {
    const int64_t local = a.batch / mesh.shape().dp;
    auto [x, y] = gpt::batch(corpus.train, a.model.context, a.batch, a.model.seed, step,
                             mesh.coord(cohort::MeshDim::dp) * local, local);
    for (auto& g : opt->param_groups())
      static_cast<torch::optim::AdamWOptions&>(g.options()).lr(cohort::torch::warmup_cosine_lr(step, a.warmup, total_steps, a.lr, 0.1));
    opt->zero_grad();
    ddp->pre_forward();
    torch::Tensor loss = model->forward(x, y);
    loss.backward();  // tp collectives inside; dp averaging by DDP
    if (a.model.sequence_parallel) cohort::torch::tp::sync_sequence_parallel_grads(*model, mesh.tp());
    if (a.clip > 0)
      cohort::torch::tp::clip_grad_norm(*model, a.clip, mesh.model_parallel(), mesh.coord(cohort::MeshDim::tp));
    opt->step();
    ++step;
    return cohort::torch::allreduce_scalar(mesh.dp(), loss.item<double>()) / mesh.shape().dp;
  }

  double validate() {
    torch::NoGradGuard no_grad;
    const int64_t dp = mesh.shape().dp, per = (a.val_seqs + dp - 1) / dp;
    const int64_t first = mesh.coord(cohort::MeshDim::dp) * per, n = std::max<int64_t>(0, std::min(per, a.val_seqs - first));
    double sum = 0;
    for (int64_t at = first; at < first + n; at += 32) {
      const int64_t k = std::min<int64_t>(32, first + n - at);
      auto [x, y] = gpt::val_batch(corpus.val, a.model.context, a.val_seqs, at, k);
      sum += model->forward(x, y).item<double>() * static_cast<double>(k);
    }
    return cohort::torch::allreduce_scalar(mesh.dp(), sum) / static_cast<double>(a.val_seqs);
  }

  void run() {
    const int64_t params = local_params(*model);
    if (lead)
      std::printf("gpt: %s; %lld parameters (%lld on this rank); %zu files, %lld training and %lld validation bytes\n",
                  mesh.describe().c_str(), static_cast<long long>(a.model.params()), static_cast<long long>(params),
                  corpus.files.size(), static_cast<long long>(corpus.train.size(0)),
                  static_cast<long long>(corpus.val.size(0)));
    using clock = std::chrono::steady_clock;
    clock::time_point t0;
    int64_t timed = 0;
    double val = 0, train_sum = 0;
    int64_t train_n = 0;
    while (step < total_steps) {
      if (timed == 0 && step >= a.timing_warmup) t0 = clock::now();
      const double loss = train_step();
      if (step > a.timing_warmup) ++timed;
      train_sum += loss;
      ++train_n;
      if (lead && (step % a.print_every == 0 || step == total_steps))
        std::printf(a.print_every == 1 ? "step %lld loss %.12g\n" : "step %lld loss %.4f\n", static_cast<long long>(step), loss);
      if (step % a.epoch_steps == 0 || step == total_steps) {
        const double secs = std::chrono::duration<double>(clock::now() - t0).count();
        val = validate();
        if (lead)
          std::printf("epoch %lld step %lld train_loss %.4f val_loss %.4f tokens/s %.0f\n",
                      static_cast<long long>((step + a.epoch_steps - 1) / a.epoch_steps), static_cast<long long>(step),
                      train_sum / train_n, val, timed ? timed * a.batch * a.model.context / secs : 0.0);
        train_sum = 0;
        train_n = 0;
        if (!a.save.empty()) save();
      }
      std::fflush(stdout);
    }
    const double secs = std::chrono::duration<double>(clock::now() - t0).count();
    if (lead)
      std::printf("RESULT gpt dp=%d tp=%d pp=1 sp=%d params=%lld params_per_rank=%lld steps=%lld tokens_per_s=%.0f "
                  "val_loss=%.4f\n",
                  mesh.shape().dp, mesh.shape().tp, a.model.sequence_parallel ? 1 : 0,
                  static_cast<long long>(a.model.params()), static_cast<long long>(params),
                  static_cast<long long>(step), timed ? timed * a.batch * a.model.context / secs : 0.0, val);
  }
};

// Whether a launcher (cohort run, torchrun, mpirun, srun) started this process.
bool launched() {
  for (const char* v : {"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "PMIX_RANK"})
    if (std::getenv(v)) return true;
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cohort GPT example: tensor and data parallelism on a small character-level transformer"};
  Args args;
  parse(app, args);
  CLI11_PARSE(app, argc, argv);
  try {
    gpt::GptImpl::check(args.model, args.tp);  // before any process group: a clear error at once
    cohort::InitOptions init;
    if (!launched()) {  // started by hand: one process
      init.rank = 0;
      init.world_size = 1;
      init.store = std::make_shared<cohort::MemoryStore>();
    }
    auto world = cohort::init_process_group(init);
    Trainer(args, world).run();
    world->shutdown();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
