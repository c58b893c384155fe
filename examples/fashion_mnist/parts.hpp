// The parts train() is made of, each small enough to copy on its own. Every
// declaration says what the part needs and what it does; the file named in
// each section holds it:
//   setup.cpp          the device, the data, the model, the optimizer, DDP
//   checkpointing.cpp  where the run stands; writing a checkpoint; resuming
//   loop.cpp           one training step, one epoch, evaluation
//   train.cpp          train(), the outline that calls them in order, and the
//                      lines it reports
// Every rank calls each part; "rank 0 prints" marks the ones that print.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cohort/cohort.hpp"
#include "cohort/data.hpp"
#include "cohort/torch.hpp"
#include "cohort/torch_train.hpp"
#include "cohort/torch_fsdp.hpp"
#include "cohort/torch_zero.hpp"
#include "train.hpp"

// The batches that `samples` samples fill, the last one possibly partial.
inline int64_t batches(int64_t samples, int64_t batch_size) { return (samples + batch_size - 1) / batch_size; }

// ---- setup.cpp ----

// A model behind one forward function, whichever class --model chose.
struct Model {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(torch::Tensor)> forward;
};

// The optimizer and how it steps (--optimizer-step): cohort's fused one-pass
// update or the optimizer's own step(), the same arithmetic.
struct Optimizer {
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::function<void()> step;
};

// --device: cpu, cuda or auto for this rank; throws InvalidArgument with the
// reason and the fix when the device cannot be used.
torch::Device pick_device(const std::string& want, const cohort::ProcessGroup& pg);
// The train (60000 images) or test (10000) split in `dir`; an IoError names
// the file, what is wrong with it, and --data-dir.
cohort::data::FashionMnist load_fashion_mnist(const std::string& dir, bool train);
// --model's network, initialised from LibTorch's generator (seed it first),
// moved to `device`. With `shard_group` (--shard fsdp) it is built under
// FsdpShardedInit: each layer sharded over that group as soon as it exists,
// so the whole model is never in one rank's memory (collective).
Model make_model(const std::string& name, const torch::Device& device,
                 const std::shared_ptr<cohort::ProcessGroup>& shard_group = nullptr);
// --optimizer over `params` (the model's, on its device already; under
// --shard fsdp the FSDP's shards) at learning rate `lr`.
Optimizer make_optimizer(const TrainConfig& cfg, const std::vector<torch::Tensor>& params, double lr);
// DistributedDataParallel over the model as the flags ask, or nullptr with
// --no-ddp (which refuses more than one rank). Collective: its constructor
// broadcasts rank 0's weights, so build it after a resume has loaded them.
// Rank 0 prints when the gradients cannot be views of the buckets.
std::unique_ptr<cohort::torch::DistributedDataParallel> make_ddp(
    const TrainConfig& cfg, const Model& model, const std::shared_ptr<cohort::ProcessGroup>& pg,
    const torch::Device& device, const std::shared_ptr<cohort::ddp::PowerSgdState>& powersgd = nullptr);
// --comm-hook powersgd: the hook's state (iteration, Qs, error feedback),
// made before a resume loads it and make_ddp hands it to the hook; else null.
std::shared_ptr<cohort::ddp::PowerSgdState> make_powersgd_state(const TrainConfig& cfg);

// --shard zero1|zero2: a ZeroOptimizer over the model in place of DDP and
// the optimizer (the same options as make_optimizer), or nullptr with
// --shard none. Collective, like make_ddp; throws InvalidArgument for the
// flags it cannot run with, naming them.
std::unique_ptr<cohort::torch::ZeroOptimizer> make_zero(const TrainConfig& cfg, const Model& model,
                                                        const std::shared_ptr<cohort::ProcessGroup>& pg, double lr);

// --shard fsdp: FullyShardedDataParallel over the model built by
// make_model(..., pg), or nullptr otherwise. From then on model.forward
// calls its pre_forward() first (training and evaluation). Collective;
// throws InvalidArgument for the flags it cannot run with, naming them.
std::unique_ptr<cohort::torch::FullyShardedDataParallel> make_fsdp(const TrainConfig& cfg, Model& model,
                                                                   const std::shared_ptr<cohort::ProcessGroup>& pg);

// ---- checkpointing.cpp ----

// Where the run stands: a checkpoint records it and a resume restores it.
struct Progress {
  int64_t step = 0;      // optimizer steps taken
  int64_t epoch = 0;     // the epoch under way (0-based)
  int64_t position = 0;  // samples of that epoch this rank has trained on: the sampler's position
  std::string resumed_from;  // the checkpoint this run resumed from ("": it started from scratch)
  std::string saved_shard = "none";  // the --shard that checkpoint was written with (none, zero1, zero2, fsdp)
  int saved_world = 0;                // the world size that wrote it
  bool saved_powersgd = false;        // it holds PowerSGD's state ("powersgd.rank<r>") ...
  bool same_buckets = false;          // ... for DDP buckets cut as this run's (--bucket-cap-mb, --first-bucket-mb)
  // The runs (job ids) this one continues: the resumed checkpoint's run and
  // the runs that one continued. --keep counts their checkpoints as this run's.
  std::vector<std::string> lineage;
};

// Linear warmup, then cosine decay to 0 at `total` steps, from `peak` (the
// base learning rate scaled by the world size). The schedule's step is the
// run's step + offset: they differ after a resume at another world size,
// which continues the schedule from the same point of the run.
struct LrSchedule {
  double peak = 0;
  int warmup = 0;
  int64_t total = 0;
  int64_t offset = 0;
  double lr(int64_t step) const { return cohort::torch::warmup_cosine_lr(step + offset, warmup, total, peak); }
};

// TORCHELASTIC_RESTART_COUNT: how often the launcher has restarted the job (0: the first attempt).
int restart_count();
// The job's id, the same in every restart: cohort run's COHORT_RUN_ID, else
// torchrun's TORCHELASTIC_RUN_ID, else "".
std::string job_run_id();
// What the checkpoints record of this run's configuration: what a resume
// must match, what it may change, and the job's id.
nlohmann::json run_config(const TrainConfig& cfg, const torch::Device& device, int64_t train_samples, int world,
                          const std::string& run_id);
// Where this run starts: from scratch, or where the checkpoint that --resume
// or a restart chooses left off, with the model, optimizer, scaler, schedule
// offset and CPU RNG restored. Collective (the ranks verify and choose together, every rank loads;
// --checkpoint-dir must be visible to every rank); rank 0 prints what it
// chose and skipped. Throws InvalidArgument when the checkpoint does not fit
// this run (`config`, from run_config()). `per_rank_samples` is the sampler's size.
// Under --shard fsdp (`fsdp` set) the model's and optimizer's shards load
// into it, resharded from the world that wrote them. A --shard fsdp
// checkpoint resumes in a run without FSDP and the other way round: the
// state is gathered from every rank's part, or cut into this run's.
Progress resume(const TrainConfig& cfg, cohort::ProcessGroup& pg, const nlohmann::json& config,
                int64_t per_rank_samples, Model& model, torch::optim::Optimizer& optimizer,
                cohort::torch::GradScaler& scaler, LrSchedule& schedule,
                cohort::torch::FullyShardedDataParallel* fsdp = nullptr);
// Saves a checkpoint of `at` into --checkpoint-dir (nothing without one),
// keeping the newest --keep. Collective: every rank calls it; barriers
// before and after. Without --shard rank 0 writes it all; with --shard
// (`zero` set) every rank writes its part of the optimizer state beside rank
// 0's model (save_checkpoint_sharded). Rank 0 prints.
// Under --shard fsdp (`fsdp` set) every rank writes "model.rank<r>" and
// "optimizer.rank<r>" and no rank the whole model.
// With `powersgd` every rank also writes "powersgd.rank<r>" (its error
// feedback is its own), so the hook continues exactly after a resume.
void write_checkpoint(cohort::ProcessGroup& pg, const TrainConfig& cfg, const Progress& at, const Model& model,
                      torch::optim::Optimizer& optimizer, cohort::torch::ZeroOptimizer* zero,
                      cohort::torch::FullyShardedDataParallel* fsdp, const cohort::torch::GradScaler& scaler,
                      const LrSchedule& schedule, const nlohmann::json& config,
                      const cohort::ddp::PowerSgdState* powersgd = nullptr);
// --comm-hook powersgd after a resume: the hook's state from the checkpoint
// `at` resumed from (this rank's file at the same world size; at another,
// rank 0's iteration and Qs, without error feedback). A checkpoint without
// it (written without the hook) leaves the state fresh; rank 0 says so.
void restore_powersgd(cohort::ddp::PowerSgdState& state, cohort::ProcessGroup& pg, const Progress& at);
// --shard after a resume: the optimizer state of the checkpoint `at` resumed
// from, into this rank's shard: resharded from the world that wrote it to
// this one when it is sharded (each rank reads only the files that hold its
// part), cut from the whole state when a run without --shard (or with
// --shard fsdp: gathered first) wrote it.
// Collective: when any rank fails, every rank throws.
void restore_sharded_optimizer(cohort::torch::ZeroOptimizer& zero, const Model& model, cohort::ProcessGroup& pg,
                               const Progress& at);

// ---- loop.cpp ----

// What one rank trains with: train() builds it once, the loop's parts use it.
struct Trainer {
  const TrainConfig& cfg;
  cohort::ProcessGroup& pg;
  torch::Device device;
  Model& model;
  Optimizer& optimizer;
  cohort::torch::GradScaler& scaler;           // enabled with --fp16-autocast only
  cohort::torch::DistributedDataParallel* ddp;  // nullptr with --no-ddp or --shard
  cohort::torch::ZeroOptimizer* zero;           // --shard zero1|zero2, else nullptr
  cohort::torch::FullyShardedDataParallel* fsdp;  // --shard fsdp, else nullptr
  std::vector<torch::Tensor> params;            // the model's parameters, for clipping and counting
  cohort::StopSignal* stop = nullptr;           // with --checkpoint-dir: SIGTERM stops the run after an agreed step
};

// Steps past --warmup-timing-steps and the seconds they took, for the throughput summary.
struct StepTimes {
  int64_t steps = 0;
  double seconds = 0;
};

struct EpochResult {
  bool stopped = false;   // --max-steps was reached in this epoch, or a stop signal
  int signal = 0;         // that signal (SIGTERM): every rank stopped after the same step
  double seconds = 0;     // the epoch's wall time on this rank
  double train_loss = 0;  // the mean over this rank's steps, averaged over the ranks
};

// One step on the batch (x, y), on the model's device: learning rate `lr`,
// forward (under --bf16/--fp16-autocast), backward (DDP averages the
// gradients while it runs), clipping, the optimizer step. Returns the
// unscaled loss. Collective with DDP.
torch::Tensor train_step(Trainer& t, const torch::Tensor& x, const torch::Tensor& y, double lr);
// Whether --checkpoint-every asks for a checkpoint after `step`.
inline bool periodic_save_at(const TrainConfig& cfg, int64_t step) {
  return cfg.ckpt_every > 0 && step % cfg.ckpt_every == 0;
}
// Trains epoch `at.epoch` from sample `at.position` of this rank's share to
// its end, until --max-steps, or until the ranks agree on a stop signal
// (t.stop, checked after every step); advances `at`. Calls `save` every
// --checkpoint-every steps (not at the epoch's last: the end-of-epoch save
// follows). Rank 0 prints progress, and with --log-losses every step's loss.
// Collective.
EpochResult train_epoch(Trainer& t, const cohort::data::FashionMnist& train_set,
                        cohort::data::DistributedSampler& sampler, Progress& at, const LrSchedule& schedule,
                        cohort::StepMetrics& metrics, StepTimes& timed,
                        const std::function<void(const Progress&)>& save);
// Test accuracy over the whole test set: each rank evaluates every world-th
// sample and the counts are summed. Collective.
double evaluate(Model& model, const cohort::data::FashionMnist& test, cohort::ProcessGroup& pg,
                const torch::Device& device);
