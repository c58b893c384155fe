// examples/gpt: a small character-level GPT trained with tensor, pipeline and
// data parallelism (docs/parallelism.md).
//
//   cohort run --nproc-per-node 4 build/gpt --tp 2 --dp 2 --epochs 1
//   cohort run --nproc-per-node 8 build/gpt --tp 2 --pp 2 --dp 2 --micro 4
//
// The world is a cohort::Mesh of dp x tp x pp ranks (tp innermost, so a tp
// group stays inside a node). The model's matrices are split over the tp
// group (examples/gpt/model.hpp), its blocks over the pp stages (--chunks per
// stage with the interleaved schedule), and a cohort::torch::pp::Pipeline
// runs each step's micro-batches; DistributedDataParallel averages each
// chunk's gradients over the dp group. Every rank draws the same global batch of
// windows of the text and takes its dp slice, so any layout trains on the
// tokens one process would. Prints the loss, the validation loss per epoch and
// the tokens/s; --save writes the full (unsharded) model as a cohort
// checkpoint, which --load reads at any layout. With --save, a SIGTERM (a
// scheduler, or `cohort run` stopped) saves the step every rank agrees on
// and exits 143 (cohort::StopSignal).
#include <CLI/CLI.hpp>
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>

#include "cohort/checkpoint.hpp"
#include "cohort/mesh.hpp"
#include "cohort/stop_signal.hpp"
#include "cohort/torch.hpp"
#include "cohort/torch_pipeline.hpp"
#include "cohort/torch_train.hpp"
#include "data.hpp"
#include "model.hpp"

namespace {

struct Args {
  int tp = 1, pp = 1, dp = 0;  // dp 0: the world size / (tp * pp)
  int chunks = 1, micro = 1;
  std::string schedule = "1f1b";
  gpt::Config model;
  int64_t batch = 32;  // sequences per step, over all dp ranks
  int64_t epochs = 1, epoch_steps = 0, max_steps = 0;
  double lr = 2e-3, clip = 1.0;
  int64_t warmup = 50, decay_steps = 0;
  std::string dtype = "f32", data = "/usr/share/games/fortunes", save, load, trace;
  int64_t val_seqs = 256, print_every = 50, timing_warmup = 5;
};

void parse(CLI::App& app, Args& a) {
  app.add_option("--tp", a.tp, "tensor-parallel degree (divides --heads)")->check(CLI::PositiveNumber);
  app.add_option("--pp", a.pp, "pipeline stages")->check(CLI::PositiveNumber);
  app.add_option("--dp", a.dp, "data-parallel degree (default: world size / (tp x pp))")->check(CLI::NonNegativeNumber);
  app.add_option("--schedule", a.schedule, "pipeline schedule: gpipe, 1f1b or interleaved");
  app.add_option("--chunks", a.chunks, "model chunks per stage (interleaved schedule)")->check(CLI::PositiveNumber);
  app.add_option("--micro", a.micro, "micro-batches per step")->check(CLI::PositiveNumber);
  app.add_option("--layers", a.model.layers, "transformer blocks")->check(CLI::PositiveNumber);
  app.add_option("--dim", a.model.dim, "model width")->check(CLI::PositiveNumber);
  app.add_option("--heads", a.model.heads, "attention heads")->check(CLI::PositiveNumber);
  app.add_option("--context", a.model.context, "tokens per sequence")->check(CLI::PositiveNumber);
  app.add_flag("--sequence-parallel", a.model.sequence_parallel, "split the activations between blocks along the sequence");
  app.add_flag("--recompute", a.model.recompute,
               "activation recomputation: keep each block's input only and run the block again in backward");
  app.add_option("--dropout", a.model.dropout, "dropout probability (embedding, attention, residual branches)");
  app.add_option("--seed", a.model.seed, "weights, batches and dropout masks");
  app.add_option("--batch", a.batch, "sequences per step over all data-parallel ranks")->check(CLI::PositiveNumber);
  app.add_option("--epochs", a.epochs, "epochs (an epoch: --epoch-steps steps)")->check(CLI::PositiveNumber);
  app.add_option("--epoch-steps", a.epoch_steps, "steps per epoch (default: the training text's tokens once)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-steps", a.max_steps, "stop after this many steps (0: run every epoch)")->check(CLI::NonNegativeNumber);
  app.add_option("--lr", a.lr, "peak learning rate (AdamW, warmup then cosine)")->check(CLI::PositiveNumber);
  app.add_option("--warmup", a.warmup, "warmup steps")->check(CLI::NonNegativeNumber);
  app.add_option("--decay-steps", a.decay_steps, "length of the warmup + cosine schedule (default: the steps this run "
                                                 "trains to; fix it to stop early and resume exactly)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--clip", a.clip, "clip the global gradient norm (0: off)")->check(CLI::NonNegativeNumber);
  app.add_option("--dtype", a.dtype, "f32 or f64")->check(CLI::IsMember({"f32", "f64"}));
  app.add_option("--data", a.data, "directory of text files (default: Debian's fortunes)");
  app.add_option("--val-seqs", a.val_seqs, "validation sequences (rounded up to a multiple of --batch)")
      ->check(CLI::PositiveNumber);
  app.add_option("--print-every", a.print_every, "print the loss every N steps (1: every step, full precision)")
      ->check(CLI::PositiveNumber);
  app.add_option("--save", a.save, "checkpoint directory: the full model and AdamW state after every epoch");
  app.add_option("--load", a.load, "start from the newest checkpoint in this directory (any layout)");
  app.add_option("--schedule-trace", a.trace, "write each rank's pipeline actions of the last step to PREFIX.rankR");
}

// What does not fit, named before any process group exists.
void check_args(const Args& a) {
  gpt::StageImpl::check(a.model, a.tp);
  const auto schedule = cohort::torch::pp::parse_schedule(a.schedule);
  cohort::torch::pp::schedule_actions(schedule, 0, a.pp, a.micro, a.chunks);  // throws for counts it cannot run
  const int64_t stages = int64_t{a.pp} * a.chunks;
  if (a.model.layers < stages)
    throw cohort::InvalidArgument("gpt: --layers " + std::to_string(a.model.layers) + " cannot fill " +
                                  std::to_string(stages) + " pipeline stages (--pp " + std::to_string(a.pp) +
                                  " x --chunks " + std::to_string(a.chunks) +
                                  "): a stage would hold no block; use at least that many layers or fewer stages");
}

struct Trainer {
  Args a;
  std::shared_ptr<cohort::ProcessGroup> world;
  cohort::Mesh mesh;
  gpt::Corpus corpus;
  std::vector<gpt::Stage> chunks;                  // this rank's virtual stages
  std::shared_ptr<torch::nn::Module> all;          // the chunks as one module (clipping, counting)
  std::vector<std::unique_ptr<cohort::torch::DistributedDataParallel>> ddp;
  std::unique_ptr<cohort::torch::pp::Pipeline> pipe;
  std::unique_ptr<torch::optim::AdamW> opt;
  int64_t step = 0, total_steps = 0, local = 0, mb = 0;
  bool lead;

  Trainer(Args args, std::shared_ptr<cohort::ProcessGroup> w)
      : a(std::move(args)),
        world(w),
        mesh(w, {.dp = a.dp ? a.dp : std::max(1, w->size() / (a.tp * a.pp)), .tp = a.tp, .pp = a.pp}),
        corpus(gpt::load_corpus(a.data)),
        all(std::make_shared<torch::nn::Module>()),
        lead(w->rank() == 0) {
    const int dp = mesh.shape().dp;
    local = a.batch / dp;
    if (a.batch % dp != 0 || local % a.micro != 0)
      throw cohort::InvalidArgument("gpt: --batch " + std::to_string(a.batch) + " does not split into --dp " +
                                    std::to_string(dp) + " x --micro " + std::to_string(a.micro) + " equal micro-batches");
    mb = local / a.micro;
    build();
    std::optional<cohort::LoadedCheckpoint> ck;
    if (!a.load.empty()) ck = load();
    std::vector<cohort::torch::pp::Pipeline::ChunkForward> fns;
    cohort::torch::pp::PipelineOptions o{.schedule = cohort::torch::pp::parse_schedule(a.schedule),
                                         .micro_batches = a.micro,
                                         .chunks = a.chunks,
                                         .activation = {mb, a.model.sequence_parallel ? a.model.context / a.tp : a.model.context,
                                                        a.model.dim},
                                         .dtype = a.dtype == "f64" ? torch::kDouble : torch::kFloat};
    for (auto& c : chunks) {
      ddp.push_back(std::make_unique<cohort::torch::DistributedDataParallel>(c.ptr(), mesh.group_ptr(cohort::MeshDim::dp)));
      o.ddp.push_back(ddp.back().get());
      fns.push_back([c](const torch::Tensor& x, int) mutable { return c->forward(x); });
    }
    pipe = std::make_unique<cohort::torch::pp::Pipeline>(mesh.group_ptr(cohort::MeshDim::pp), fns, o);
    opt = std::make_unique<torch::optim::AdamW>(all->parameters(), torch::optim::AdamWOptions(a.lr).weight_decay(0.0));
    if (ck) {
      const auto state = files_named(*ck, "optim");
      for (auto& c : chunks) cohort::torch::tp::load_full_optimizer_state(*c, *opt, state);
    }
    if (a.epoch_steps == 0) a.epoch_steps = std::max<int64_t>(1, corpus.train.size(0) / (a.batch * a.model.context));
    total_steps = a.epochs * a.epoch_steps;
    if (a.max_steps > 0) total_steps = std::min(total_steps, a.max_steps);
  }

  int virtual_stage(int c) const { return c * mesh.shape().pp + mesh.coord(cohort::MeshDim::pp); }

  void build() {
    const int64_t stages = int64_t{a.pp} * a.chunks;
    const auto ranges = cohort::torch::pp::stage_ranges(a.model.layers, stages);  // blocks per virtual stage
    for (int c = 0; c < a.chunks; ++c) {
      const int vs = virtual_stage(c);
      const auto [first, last] = ranges[vs];
      const uint64_t replica = static_cast<uint64_t>(mesh.coord(cohort::MeshDim::dp)) * 4096 + static_cast<uint64_t>(vs);
      chunks.emplace_back(a.model, mesh.group_ptr(cohort::MeshDim::tp), first, last, vs == 0, vs == stages - 1, replica);
      if (a.dtype == "f64") chunks.back()->to(torch::kDouble);
      all->register_module("chunk" + std::to_string(c), chunks.back().ptr());
    }
  }

  // The tensors of every file whose name starts with `prefix`: each stage of
  // the saving run wrote its own.
  static std::vector<cohort::NamedTensor> files_named(const cohort::LoadedCheckpoint& ck, const std::string& prefix) {
    std::vector<cohort::NamedTensor> out;
    for (const auto& [name, tensors] : ck.files)
      if (name.rfind(prefix, 0) == 0) out.insert(out.end(), tensors.begin(), tensors.end());
    return out;
  }

  // Any layout's checkpoint: the files model-stage* hold the full model's
  // tensors by name (optim-stage* the optimizer's, loaded once it exists).
  cohort::LoadedCheckpoint load() {
    auto ck = cohort::load_latest_valid(a.load);
    if (!ck) throw cohort::InvalidArgument("gpt: --load " + a.load + " holds no valid checkpoint");
    const auto state = files_named(*ck, "model");
    for (auto& c : chunks) cohort::torch::tp::load_full_module_state(*c, state);
    step = ck->step;
    if (lead) std::printf("loaded %s (step %lld)\n", ck->path.c_str(), static_cast<long long>(step));
    load_dropout_streams(*ck);
    return *ck;
  }

  // dp, tp, pp and chunks: a rank's dropout streams belong to its place in them.
  std::string layout() const {
    return "dp" + std::to_string(mesh.shape().dp) + ".tp" + std::to_string(mesh.shape().tp) + ".pp" +
           std::to_string(mesh.shape().pp) + ".chunks" + std::to_string(a.chunks);
  }
  std::string rng_file() const { return "rng.rank" + std::to_string(world->rank()); }

  // Each rank's dropout generators as it saved them, when the checkpoint was
  // written at this layout: the masks then continue as in a run never
  // stopped. At another layout the ranks' streams do not map onto these, and
  // they start afresh from --seed.
  void load_dropout_streams(const cohort::LoadedCheckpoint& ck) {
    const bool same = ck.manifest.config.find("\"layout\":\"" + layout() + "\"") != std::string::npos;
    const auto it = ck.files.find(rng_file());
    if (!same || it == ck.files.end()) {
      if (lead && a.model.dropout > 0)
        std::printf("note: %s was written at another layout (this one: %s): the dropout masks start afresh\n",
                    ck.path.c_str(), layout().c_str());
      return;
    }
    std::map<std::string, torch::Tensor> saved;
    for (const auto& t : it->second) saved[t.name] = cohort::torch::from_named(t);
    for (size_t c = 0; c < chunks.size(); ++c) {
      const std::string at = "chunk" + std::to_string(c);
      if (!saved.count(at + ".replicated") || !saved.count(at + ".parallel"))
        throw cohort::InvalidArgument("gpt: " + ck.path + "'s " + rng_file() + " lacks " + at +
                                      "'s dropout streams: the checkpoint is damaged or from another program");
      chunks[c]->rng->replicated().set_state(saved.at(at + ".replicated"));
      chunks[c]->rng->parallel().set_state(saved.at(at + ".parallel"));
    }
  }

  // The full model: tp rank 0 of dp replica 0 of each stage writes its
  // chunks' full tensors, one file per virtual stage.
  void save() {
    std::map<std::string, std::vector<cohort::NamedTensor>> files;
    for (int c = 0; c < a.chunks; ++c) {
      auto state = cohort::torch::tp::full_module_state(*chunks[c]);  // collective over tp
      auto optim = cohort::torch::tp::full_optimizer_state(*chunks[c], *opt);
      if (mesh.coord(cohort::MeshDim::tp) == 0 && mesh.coord(cohort::MeshDim::dp) == 0) {
        files["model-stage" + std::to_string(virtual_stage(c))] = std::move(state);
        files["optim-stage" + std::to_string(virtual_stage(c))] = std::move(optim);
      }
    }
    // Every rank's dropout streams, for a resume at this layout.
    auto& rng = files[rng_file()];
    for (size_t c = 0; c < chunks.size(); ++c) {
      const std::string at = "chunk" + std::to_string(c);
      rng.push_back(cohort::torch::to_named(at + ".replicated", chunks[c]->rng->replicated().get_state()));
      rng.push_back(cohort::torch::to_named(at + ".parallel", chunks[c]->rng->parallel().get_state()));
    }
    cohort::Manifest m;
    m.world_size = world->size();
    m.config = "{\"model\":\"gpt\",\"layout\":\"" + layout() + "\"}";
    const std::string dir = cohort::save_checkpoint_sharded(*world, a.save, step, files, m, {.keep_last = 2});
    if (lead) std::printf("saved %s\n", dir.c_str());
  }

  void set_lr() {
    for (auto& g : opt->param_groups())
      static_cast<torch::optim::AdamWOptions&>(g.options())
          .lr(cohort::torch::warmup_cosine_lr(step, a.warmup, a.decay_steps ? a.decay_steps : total_steps, a.lr, 0.1));
  }

  double train_step() {
    auto [x, y] = gpt::batch(corpus.train, a.model.context, a.batch, a.model.seed, step,
                             mesh.coord(cohort::MeshDim::dp) * local, local);
    set_lr();
    opt->zero_grad();
    // tp collectives inside each chunk; DDP averages each chunk over dp on its last backward.
    const double loss = pipe->step([&](int m) { return x.narrow(0, m * mb, mb); },
                                   [&](const torch::Tensor& logits, int m) {
                                     return chunks.back()->loss(logits, y.narrow(0, m * mb, mb));
                                   });
    if (a.model.sequence_parallel) cohort::torch::tp::sync_sequence_parallel_grads(*all, mesh.tp());
    if (a.clip > 0) cohort::torch::tp::clip_grad_norm(*all, a.clip, mesh.model_parallel(), mesh.coord(cohort::MeshDim::tp));
    opt->step();
    ++step;
    return cohort::torch::allreduce_scalar(mesh.dp(), loss) / mesh.shape().dp;
  }

  double validate() {
    all->eval();  // no dropout
    const int64_t passes = (a.val_seqs + a.batch - 1) / a.batch, total = passes * a.batch;
    double sum = 0;
    for (int64_t i = 0; i < passes; ++i) {
      auto [x, y] = gpt::val_batch(corpus.val, a.model.context, total, i * a.batch + mesh.coord(cohort::MeshDim::dp) * local,
                                   local);
      sum += pipe->evaluate([&](int m) { return x.narrow(0, m * mb, mb); },
                            [&](const torch::Tensor& logits, int m) {
                              return chunks.back()->loss(logits, y.narrow(0, m * mb, mb));
                            });
    }
    all->train();
    return cohort::torch::allreduce_scalar(mesh.dp(), sum) / static_cast<double>(passes * mesh.shape().dp);
  }

  void write_trace() const {
    std::FILE* f = std::fopen((a.trace + ".rank" + std::to_string(world->rank())).c_str(), "w");
    if (!f) throw std::runtime_error("gpt: cannot write " + a.trace + ".rank" + std::to_string(world->rank()));
    const auto& st = pipe->stats();
    std::fprintf(f, "# stage %d of %d, dp %d, tp %d, schedule %s, micro %d, chunks %d, step_s %.6f, origin_s %.6f\n",
                 mesh.coord(cohort::MeshDim::pp), mesh.shape().pp, mesh.coord(cohort::MeshDim::dp),
                 mesh.coord(cohort::MeshDim::tp), a.schedule.c_str(), a.micro, a.chunks, st.step_s, st.origin_s);
    for (const auto& t : st.actions)
      std::fprintf(f, "%c %d %d %.6f %.6f\n", t.action.kind == cohort::torch::pp::Action::Forward ? 'F' : 'B',
                   t.action.micro, t.action.chunk, t.start_s, t.end_s);
    std::fclose(f);
  }

  // Returns the exit code: 0, or 128 + a stop signal the ranks agreed on.
  int run();
};

int Trainer::run() {
  // With --save, SIGTERM ends the run after a step every rank agrees on, saving it.
  std::optional<cohort::StopSignal> stop;
  if (!a.save.empty()) stop.emplace();
  int64_t params = 0;
  for (const auto& p : all->parameters()) params += p.numel();
  if (lead)
    std::printf("gpt: %s; %s schedule, %d micro-batches of %lld; %lld parameters (%lld on this rank); %zu files, "
                "%lld training and %lld validation bytes\n",
                mesh.describe().c_str(), a.schedule.c_str(), a.micro, static_cast<long long>(mb),
                static_cast<long long>(a.model.params()), static_cast<long long>(params), corpus.files.size(),
                static_cast<long long>(corpus.train.size(0)), static_cast<long long>(corpus.val.size(0)));
  using clock = std::chrono::steady_clock;
  double train_s = 0, bubble_sum = 0, val = 0, train_sum = 0;
  int64_t timed = 0, train_n = 0;
  auto rate = [&] { return train_s > 0 ? static_cast<double>(timed * a.batch * a.model.context) / train_s : 0.0; };
  while (step < total_steps) {
    const auto t0 = clock::now();
    const double loss = train_step();
    if (step > a.timing_warmup) {  // training alone: validation and saving are not counted
      train_s += std::chrono::duration<double>(clock::now() - t0).count();
      bubble_sum += pipe->stats().bubble();
      ++timed;
    }
    train_sum += loss;
    ++train_n;
    if (lead && (step % a.print_every == 0 || step == total_steps))
      std::printf(a.print_every == 1 ? "step %lld loss %.12g\n" : "step %lld loss %.4f\n", static_cast<long long>(step), loss);
    if (step % a.epoch_steps == 0 || step == total_steps) {
      val = validate();
      if (lead)
        std::printf("epoch %lld step %lld train_loss %.4f val_loss %.4f tokens/s %.0f\n",
                    static_cast<long long>((step + a.epoch_steps - 1) / a.epoch_steps), static_cast<long long>(step),
                    train_sum / static_cast<double>(train_n), val, rate());
      train_sum = 0;
      train_n = 0;
      if (!a.save.empty()) save();
    }
    std::fflush(stdout);
    const int sig = stop && step < total_steps ? stop->agreed(*world) : 0;
    if (sig != 0) {
      if (step % a.epoch_steps != 0) save();  // (an epoch's last step was saved above)
      if (lead) {
        const char* name = sigabbrev_np(sig);
        std::printf("stopped at step %lld: SIG%s reached the job; the state after this step is in %s (--load "
                    "continues from it)\n",
                    static_cast<long long>(step), name ? name : "?", a.save.c_str());
        std::fflush(stdout);
      }
      return 128 + sig;
    }
  }
  if (!a.trace.empty()) write_trace();
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  const double peak_mb = cohort::torch::allreduce_scalar(*world, usage.ru_maxrss / 1024.0, cohort::ReduceOp::Max);
  if (lead)
    std::printf("RESULT gpt dp=%d tp=%d pp=%d sp=%d recompute=%d schedule=%s micro=%d chunks=%d params=%lld "
                "params_per_rank=%lld steps=%lld tokens_per_s=%.0f bubble=%.3f val_loss=%.4f peak_rss_mb=%.1f\n",
                mesh.shape().dp, mesh.shape().tp, mesh.shape().pp, a.model.sequence_parallel ? 1 : 0,
                a.model.recompute ? 1 : 0, a.schedule.c_str(), a.micro, a.chunks, static_cast<long long>(a.model.params()),
                static_cast<long long>(params), static_cast<long long>(step), rate(),
                timed ? bubble_sum / static_cast<double>(timed) : 0.0, val, peak_mb);
  return 0;
}

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
    check_args(args);  // before any process group: a clear error at once
    cohort::InitOptions init;
    if (!launched()) {  // started by hand: one process
      init.rank = 0;
      init.world_size = 1;
      init.store = std::make_shared<cohort::MemoryStore>();
    }
    auto world = cohort::init_process_group(init);
    const int rc = Trainer(args, world).run();
    world->shutdown();
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt: error: %s\n", e.what());
    return 1;
  }
}
