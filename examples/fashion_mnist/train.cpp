// train(): one rank's training program, as an outline of calls to the parts
// in parts.hpp, in the order they run:
//   1. the process group, the device, the data, the model, the optimizer and
//      the GradScaler (setup.cpp);
//   2. where the run starts: from scratch, or a checkpoint's state
//      (checkpointing.cpp); then DDP, which broadcasts rank 0's weights;
//   3. each epoch: train_epoch (loop.cpp), evaluate, rank 0's epoch lines, a
//      checkpoint at the epoch's end;
//   4. the summary: throughput (RESULT ddp_summary), the step metrics, the
//      final test accuracy.
// Tests, benchmarks and the GPU check parse the lines rank 0 prints
// (tests/torch, bench/, scripts/gpu-check.sh): change their wording with them.
#include "train.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <optional>

#include <sys/resource.h>

#include "parts.hpp"

namespace {

// The last test accuracy measured: in epoch `epoch` (0: none), after step `step`,
// `partial`: part-way through that epoch (--max-steps with --eval-at-stop).
struct LastEval {
  double acc = 0;
  int64_t epoch = 0;
  int64_t step = 0;
  bool partial = false;
};

// Rank 0's lines after evaluating epoch `at.epoch`.
void print_epoch(const TrainConfig& cfg, int world, const Progress& at, const EpochResult& r, bool cut_short,
                 double acc) {
  if (cut_short)
    std::printf("stopped at step %lld (--max-steps), part-way through the epoch\n", static_cast<long long>(at.step));
  std::printf("epoch %lld: test accuracy %.2f%% (train loss %.4f, %.1f s)\n", static_cast<long long>(at.epoch + 1),
              acc * 100, r.train_loss, r.seconds);
  std::printf("RESULT ddp model=%s world=%d epoch=%lld epoch_time_s=%.2f train_loss=%.4f test_acc=%.4f\n",
              cfg.model.c_str(), world, static_cast<long long>(at.epoch + 1), r.seconds, r.train_loss, acc);
  std::fflush(stdout);
}

// Images/s of the timed steps, as fast as the slowest rank (collective); rank 0 prints.
void print_throughput(const TrainConfig& cfg, cohort::ProcessGroup& pg, const std::vector<torch::Tensor>& params,
                      int64_t steps, const StepTimes& timed) {
  const int world = pg.size();
  double slowest = cohort::torch::allreduce_scalar(pg, timed.seconds, cohort::ReduceOp::Max);
  if (pg.rank() != 0) return;
  double ips = timed.steps > 0 ? world * cfg.batch_size * timed.steps / slowest : 0;
  int64_t nparams = 0;
  for (auto& p : params) nparams += p.numel();
  std::printf("RESULT ddp_summary model=%s world=%d params=%lld steps=%lld timed_steps=%lld imgs_per_s=%.1f ms_per_step=%.2f allreduce=%s\n",
              cfg.model.c_str(), world, static_cast<long long>(nparams), static_cast<long long>(steps),
              static_cast<long long>(timed.steps), ips, timed.steps ? slowest / timed.steps * 1000 : 0.0,
              cfg.no_allreduce ? (cfg.lockstep ? "off+barrier" : "off") : "on");
}

// The largest per-rank peak resident memory, and the optimizer state one rank
// holds (under --shard its shard, with what the ZeroOptimizer or FSDP keeps).
// Collective; rank 0 prints.
void print_memory(const TrainConfig& cfg, cohort::ProcessGroup& pg, torch::optim::Optimizer& optimizer,
                  cohort::torch::ZeroOptimizer* zero, cohort::torch::FullyShardedDataParallel* fsdp) {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const double peak_mb = cohort::torch::allreduce_scalar(pg, usage.ru_maxrss / 1024.0, cohort::ReduceOp::Max);
  if (pg.rank() != 0) return;
  constexpr double kMiB = 1 << 20;
  if (fsdp) {
    const auto m = fsdp->memory();
    std::printf("RESULT memory model=%s shard=fsdp world=%d peak_rss_mb=%.1f optimizer_state_mb=%.2f params=%zu "
                "shard_elements=%zu units=%zu param_shard_mb=%.2f grad_shard_mb=%.2f gather_mb=%.2f\n",
                cfg.model.c_str(), pg.size(), peak_mb, cohort::torch::optimizer_state_bytes(optimizer) / kMiB, m.params,
                m.shard, m.units, m.shard_bytes / kMiB, m.grad_shard_bytes / kMiB, m.gather_bytes / kMiB);
    return;
  }
  if (!zero) {
    std::printf("RESULT memory model=%s shard=none world=%d peak_rss_mb=%.1f optimizer_state_mb=%.2f\n", cfg.model.c_str(),
                pg.size(), peak_mb, cohort::torch::optimizer_state_bytes(optimizer) / kMiB);
    return;
  }
  const auto m = zero->memory();
  std::printf("RESULT memory model=%s shard=%s world=%d peak_rss_mb=%.1f optimizer_state_mb=%.2f params=%zu "
              "shard_elements=%zu param_mb=%.2f grad_mb=%.2f grad_shard_mb=%.2f\n",
              cfg.model.c_str(), cfg.shard.c_str(), pg.size(), peak_mb, m.optimizer_state_bytes / kMiB, m.params,
              m.shard, m.param_bytes / kMiB, m.grad_bytes / kMiB, m.grad_shard_bytes / kMiB);
}

// Rank 0's last line: the accuracy of the final weights, or the last one
// measured when the run stopped after it.
void print_final_accuracy(const TrainConfig& cfg, int world, int64_t step, const LastEval& last) {
  if (last.epoch > 0 && last.step == step)
    std::printf("final test accuracy: %.2f%% after %sepoch %lld of %d (step %lld), %d rank%s\n", last.acc * 100,
                last.partial ? "part of " : "", static_cast<long long>(last.epoch), cfg.epochs,
                static_cast<long long>(step), world, world == 1 ? "" : "s");
  else if (last.epoch > 0)
    std::printf("last measured test accuracy: %.2f%% after epoch %lld (step %lld); the run stopped at step %lld "
                "without measuring it again (--eval-at-stop does)\n",
                last.acc * 100, static_cast<long long>(last.epoch), static_cast<long long>(last.step),
                static_cast<long long>(step));
}

// The run stopped after step at.step because every rank agreed on `signal`
// (train_epoch). Part-way through an epoch the caller saved that step; at
// the epoch's last step (`epoch_done`) the end-of-epoch checkpoint is saved
// here. The process then ends as the signal would have ended it, 128 +
// signal, so that a scheduler does not take the run for finished.
int stop_on_signal(cohort::ProcessGroup& pg, const TrainConfig& cfg, const Progress& at, int signal, bool epoch_done,
                   const std::function<void(const Progress&)>& save) {
  if (epoch_done) {  // the epoch's last step: the checkpoint of the epoch's end, as after an evaluation
    Progress next = at;
    next.epoch += 1;
    next.position = 0;
    save(next);
  }
  if (pg.rank() == 0) {
    const char* name = sigabbrev_np(signal);
    std::printf("stopped at step %lld: SIG%s reached the job; the state after this step is in %s (--resume continues "
                "from it)\n",
                static_cast<long long>(at.step), name ? name : "?", cfg.ckpt_dir.c_str());
    std::fflush(stdout);
  }
  pg.shutdown();
  return 128 + signal;
}

}  // namespace

int train(const TrainConfig& cfg) {
  torch::set_num_threads(cfg.threads);
  torch::manual_seed(cfg.seed);  // before the model draws its initial weights
  auto pg = cohort::init_process_group();
  const int world = pg->size();
  const bool lead = pg->rank() == 0;
  const torch::Device device = pick_device(cfg.device, *pg);
  if (cfg.fp16_autocast && !device.is_cuda())
    throw cohort::InvalidArgument(fmt::format("--fp16-autocast runs on a GPU (--device cuda), not on {}; HINT: on the "
                                              "CPU use --bf16-autocast",
                                              device.str()));
  if (lead && device.is_cuda())
    std::printf("device: %s on every rank (%s backend)\n", device.str().c_str(), pg->backend_name().c_str());
  cohort::data::FashionMnist train_set = load_fashion_mnist(cfg.data_dir, true);
  cohort::data::FashionMnist test_set = load_fashion_mnist(cfg.data_dir, false);

  // --shard fsdp: each layer sharded as it is built, then FSDP over them
  // (before the optimizer: it steps the shards).
  Model model = make_model(cfg.model, device, cfg.shard == "fsdp" ? pg : nullptr);
  const auto fsdp = make_fsdp(cfg, model, pg);
  const double peak_lr = cohort::torch::scaled_lr(cfg.base_lr, world);
  Optimizer optimizer = make_optimizer(cfg, fsdp ? fsdp->parameters() : model.module->parameters(), peak_lr);
  // fp16 autocast: the loss is scaled before backward so small gradients do
  // not underflow in fp16; the scaler skips a step whose gradients overflowed.
  // Its scale and growth tracker are saved with the schedule (exact resume).
  cohort::torch::GradScaler scaler({.enabled = cfg.fp16_autocast});
  const int64_t train_n = cfg.train_limit > 0 ? std::min(cfg.train_limit, train_set.size()) : train_set.size();
  cohort::data::DistributedSampler sampler(train_n, {.num_replicas = world, .rank = pg->rank(), .seed = cfg.seed});
  LrSchedule schedule{.peak = peak_lr, .warmup = cfg.warmup_steps, .total = batches(sampler.size(), cfg.batch_size) * cfg.epochs};

  nlohmann::json config = run_config(cfg, device, train_n, world, job_run_id());
  Progress at = resume(cfg, *pg, config, sampler.size(), model, *optimizer.optimizer, scaler, schedule, fsdp.get());
  if (!at.lineage.empty()) config["lineage"] = at.lineage;  // the runs this one continues: --keep counts theirs too
  const auto zero = make_zero(cfg, model, pg, peak_lr);  // --shard: in place of DDP (and of `optimizer`'s step)
  if (zero && !at.resumed_from.empty()) restore_sharded_optimizer(*zero, model, *pg, at);
  const auto powersgd = make_powersgd_state(cfg);  // --comm-hook powersgd: saved with the checkpoints
  if (powersgd && !at.resumed_from.empty()) restore_powersgd(*powersgd, *pg, at);
  const auto ddp = make_ddp(cfg, model, pg, device, powersgd);
  // With checkpoints, SIGTERM (a scheduler's, or `cohort run` stopping the
  // job) ends the run after a step every rank agrees on, saving it.
  std::optional<cohort::StopSignal> on_signal;
  if (!cfg.ckpt_dir.empty()) on_signal.emplace();
  Trainer t{.cfg = cfg, .pg = *pg, .device = device, .model = model, .optimizer = optimizer, .scaler = scaler,
            .ddp = ddp.get(), .zero = zero.get(), .fsdp = fsdp.get(), .params = model.module->parameters(),
            .stop = on_signal ? &*on_signal : nullptr};
  const auto save = [&](const Progress& p) {
    write_checkpoint(*pg, cfg, p, model, *optimizer.optimizer, zero.get(), fsdp.get(), scaler, schedule, config,
                     powersgd.get());
  };

  // Step breakdown (compute / exposed communication / data wait) and the timeline's "train" track.
  cohort::StepMetrics metrics(*pg);
  StepTimes timed;
  LastEval last;
  // A run resumed from the checkpoint its --max-steps stop wrote has nothing left to train.
  const bool done = cfg.max_steps > 0 && at.step >= cfg.max_steps;
  if (done && lead)
    std::printf("nothing to train: the run is at step %lld and --max-steps is %lld\n", static_cast<long long>(at.step),
                static_cast<long long>(cfg.max_steps));
  for (bool stop = done; at.epoch < cfg.epochs && !stop;) {
    const EpochResult r = train_epoch(t, train_set, sampler, at, schedule, metrics, timed, save);
    stop = r.stopped;
    const bool cut_short = stop && at.position < sampler.size();  // --max-steps or a signal ended the epoch early
    // The steps since the last checkpoint are not lost: the stop saves its
    // state, unless --checkpoint-every saved this very step.
    if (cut_short && !periodic_save_at(cfg, at.step)) save(at);
    // (A signal agreed after the run's very last step changes nothing: the run ends as it would have.)
    const bool last_step = (cfg.max_steps > 0 && at.step >= cfg.max_steps) || (!cut_short && at.epoch + 1 >= cfg.epochs);
    if (r.signal != 0 && !last_step) return stop_on_signal(*pg, cfg, at, r.signal, !cut_short, save);
    if (cut_short && !cfg.eval_at_stop) break;
    last = {.acc = evaluate(model, test_set, *pg, device), .epoch = at.epoch + 1, .step = at.step, .partial = cut_short};
    if (lead) print_epoch(cfg, world, at, r, cut_short, last.acc);
    if (cut_short) break;
    at = {.step = at.step, .epoch = at.epoch + 1, .position = 0};
    save(at);
  }
  print_throughput(cfg, *pg, t.params, at.step, timed);
  print_memory(cfg, *pg, *optimizer.optimizer, zero.get(), fsdp.get());
  metrics.finish();
  if (lead) std::fputs(metrics.report().c_str(), stdout);
  if (lead) print_final_accuracy(cfg, world, at.step, last);
  pg->shutdown();
  return 0;
}
