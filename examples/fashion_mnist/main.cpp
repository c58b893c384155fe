// Fashion-MNIST with DistributedDataParallel: the example users copy from.
//
//   cohort run --nproc-per-node 2 build/fashion_mnist --epochs 10
//   cohort run --nproc-per-node 2 build/fashion_mnist --epochs 10 --checkpoint-dir ckpt --resume
//   cohort run --nproc-per-node 2 --max-restarts 3 build/fashion_mnist --epochs 10 --checkpoint-dir ckpt
//
// Under `cohort run --max-restarts K` (or torchrun), a restarted run
// (TORCHELASTIC_RESTART_COUNT > 0) resumes from the newest valid checkpoint by
// itself; --no-auto-resume starts it over instead.
//
// Rank 0 prints progress (epoch, step/total, loss, images/s, ETA) and the test
// accuracy after each epoch; checkpoints are written every --checkpoint-every
// steps, at each epoch's end, where --max-steps stops the run, and at the
// step the ranks agree on after a SIGTERM (a scheduler stopping the job: the
// run then exits 143); --resume continues from the newest valid one (same
// data order, step and learning rate).
//
// On GPUs (docs/gpu.md): --device cuda, one process per GPU, with
// COHORT_BACKEND=nccl; --fp16-autocast adds fp16 autocast and a GradScaler.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>

#include "cohort/cohort.hpp"
#include "cohort/data.hpp"
#include "cohort/torch.hpp"
#include "cohort/torch_train.hpp"
#include "model.hpp"
#include "train.hpp"

namespace {

// CLI11's own number checks print their range with DBL_MAX spelled out: these say what is wrong.
CLI::Validator number_check(bool zero_ok, double at_most = 1e15) {
  return CLI::Validator(
      [zero_ok, at_most](std::string& text) -> std::string {
        double v = 0;
        try {
          size_t used = 0;
          v = std::stod(text, &used);
          if (used != text.size() || !std::isfinite(v)) throw std::invalid_argument(text);
        } catch (const std::exception&) {
          return "'" + text + "' is not a number";
        }
        if (v > at_most) return fmt::format("must be at most {} (got {})", at_most, text);
        if (zero_ok ? v >= 0 : v > 0) return {};
        return fmt::format("must be {} (got {})", zero_ok ? "0 or more" : "greater than 0", text);
      },
      zero_ok ? ">= 0" : "> 0", zero_ok ? "non-negative" : "positive");
}
const CLI::Validator kPositive = number_check(false);
const CLI::Validator kNonNegative = number_check(true);
const CLI::Validator kMegabytes = number_check(false, 1 << 20);  // a bucket of up to 1 TiB

// A path that is a directory or not there yet: a file is refused at start,
// not at the first save an epoch later.
CLI::Validator directory_or_missing() {
  return CLI::Validator(
      [](std::string& dir) -> std::string {
        std::error_code ec;
        if (std::filesystem::exists(dir, ec) && !std::filesystem::is_directory(dir, ec))
          return dir + " exists and is not a directory; name a directory (it is created if missing)";
        return "";
      },
      "");
}

// --shard and what goes with it.
void add_shard_flags(CLI::App& app, TrainConfig& cfg) {
  app.add_option("--shard", cfg.shard,
                 "none: DistributedDataParallel; zero1 or zero2: ZeroOptimizer, each rank keeping 1/N of the "
                 "optimizer state (zero2: gradients reduce-scattered during backward; docs/zero.md); fsdp: "
                 "FullyShardedDataParallel, 1/N of parameters, gradients and optimizer state, each layer whole only "
                 "while it computes (docs/fsdp.md)")
      ->check(CLI::IsMember({"none", "zero1", "zero2", "fsdp"}));
  app.add_option("--param-dtype", cfg.param_dtype,
                 "with --shard fsdp: fp32, or bf16 (mixed precision: layers gathered and computing in bf16, fp32 "
                 "master shards, gradients reduced in fp32)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_flag("--cpu-offload", cfg.cpu_offload,
               "with --shard fsdp and --device cuda: keep the shards, their gradients and the optimizer's state and "
               "step in host memory; the GPU holds only the layers being gathered (docs/fsdp.md)");
}

}  // namespace

int main(int argc, char** argv) {
  TrainConfig cfg;
  CLI::App app{"Fashion-MNIST training with cohort's DistributedDataParallel; run it under `cohort run`"};
  app.add_option("--model", cfg.model,
                 "cnn (225 k parameters), mlp (10 M, communication-bound) or big-mlp (203 M: for --shard fsdp, "
                 "docs/fsdp.md)")
      ->check(CLI::IsMember({"cnn", "mlp", "big-mlp"}));
  app.add_option("--epochs", cfg.epochs, "epochs to train")
      ->check(kPositive);
  app.add_option("--train-limit", cfg.train_limit, "train on the first N images only (0: all; short runs in tests)")
      ->check(kNonNegative);
  app.add_option("--batch-size", cfg.batch_size, "per-rank batch size")
      ->check(kPositive);
  app.add_option("--optimizer", cfg.optimizer, "sgd (with --momentum) or adamw (betas 0.9, 0.999, eps 1e-8)")
      ->check(CLI::IsMember({"sgd", "adamw"}));
  auto* lr = app.add_option("--lr", cfg.base_lr,
                            "learning rate for one rank; scaled linearly with the world size (default 0.03 for sgd, "
                            "0.001 for adamw)")
                ->check(kPositive);
  app.add_option("--momentum", cfg.momentum, "SGD momentum")
      ->check(kNonNegative);
  auto* wd = app.add_option("--weight-decay", cfg.weight_decay,
                            "weight decay: L2 for sgd (default 5e-4), decoupled for adamw (default 0.01)")
      ->check(kNonNegative);
  app.add_option("--optimizer-step", cfg.optimizer_step,
                 "how the optimizer steps: fused (cohort::torch::sgd_step / adamw_step, one pass over each parameter) "
                 "or libtorch (the optimizer's own step(), one tensor operation at a time); the same arithmetic")
      ->check(CLI::IsMember({"fused", "libtorch"}));
  app.add_option("--warmup-steps", cfg.warmup_steps, "linear learning-rate warmup, then cosine decay")
      ->check(kNonNegative);
  app.add_option("--seed", cfg.seed, "model initialisation and data order");
  app.add_option("--augment", cfg.augment, "training-image augmentation: none, flip (random horizontal flips) or flip+shift (and shifts of up to 2 pixels)")
      ->check(CLI::IsMember({"none", "flip", "flip+shift"}));
  app.add_option("--threads", cfg.threads, "intra-op threads per rank")
      ->check(kPositive);
  app.add_option("--max-steps", cfg.max_steps, "stop after this many steps (0: run every epoch); with --checkpoint-dir the stop saves a checkpoint")
      ->check(kNonNegative);
  app.add_flag("--eval-at-stop", cfg.eval_at_stop,
               "when --max-steps stops the run mid-epoch, still measure and print the test accuracy");
  app.add_option("--data-dir", cfg.data_dir, "directory with the four Fashion-MNIST .gz files");
  auto* ckpt_dir = app.add_option("--checkpoint-dir", cfg.ckpt_dir, "write checkpoints here (empty: none)")
                       ->check(directory_or_missing());
  app.add_option("--checkpoint-every", cfg.ckpt_every, "steps between checkpoints (0: only at epoch ends)")
      ->check(kNonNegative);
  app.add_option("--keep", cfg.keep, "checkpoints of this run and the runs it resumed to keep (0: all)")
      ->check(kNonNegative);
  app.add_flag("--resume", cfg.resume, "continue from the newest valid checkpoint in --checkpoint-dir")
      ->needs(ckpt_dir);
  app.add_flag("!--no-auto-resume", cfg.auto_resume,
               "do not resume by itself after a restart (by default a restarted run, TORCHELASTIC_RESTART_COUNT > 0, "
               "continues from the newest valid checkpoint in --checkpoint-dir)");
  app.add_option("--comm-hook", cfg.comm_hook,
                 "gradient communication: allreduce, fp16 or bf16 (compressed), int8 (quantised with error "
                 "feedback), powersgd (low-rank, with error feedback)")
      ->check(CLI::IsMember({"allreduce", "fp16", "bf16", "int8", "powersgd"}));
  app.add_option("--powersgd-rank", cfg.powersgd_rank, "--comm-hook powersgd: the approximation rank")
      ->check(CLI::Range(1, 1024));
  app.add_option("--powersgd-start-iter", cfg.powersgd_start_iter,
                 "--comm-hook powersgd: plain allreduce for this many iterations first (at least 2)")
      ->check(CLI::Range(int64_t(2), int64_t(1) << 40));
  app.add_option("--bucket-cap-mb", cfg.bucket_cap_mb, "DDP bucket size")
      ->check(kMegabytes);
  app.add_option("--first-bucket-mb", cfg.first_bucket_mb, "DDP first bucket size (PyTorch: 1 MiB)")
      ->check(kMegabytes);
  app.add_flag("--grad-bucket-view,!--no-grad-bucket-view", cfg.grad_bucket_view,
               "gradients live in the DDP buckets (gradient_as_bucket_view): no copy out after the allreduce");
  auto* bf16 = app.add_flag("--bf16-autocast", cfg.bf16_autocast, "run the forward pass under bf16 autocast");
  app.add_flag("--fp16-autocast", cfg.fp16_autocast,
               "run the forward pass under fp16 autocast with a GradScaler (--device cuda only)")
      ->excludes(bf16);
  add_shard_flags(app, cfg);
  app.add_flag("--no-ddp", cfg.no_ddp, "train without DistributedDataParallel (one rank only): DDP's baseline");
  app.add_flag("--reduce-at-world-size-1", cfg.reduce_at_world_size_1,
               "run DDP's gradient reduction even with one rank (by default a lone rank skips it), as PyTorch does");
  app.add_flag("--ddp-wait-on-stream", cfg.ddp_wait_on_stream,
               "a CUDA module on nccl: backward orders the stream after the gradient allreduce instead of waiting "
               "on the host (the CPU queues ahead; a failure shows at the next step)");
  app.add_option("--device", cfg.device,
                 "where model, data and loss live: cpu, cuda (this rank's GPU: LOCAL_RANK's, or the nccl group's) or "
                 "auto (cuda with COHORT_BACKEND=nccl, else cpu)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  app.add_option("--clip-grad-norm", cfg.clip_grad_norm, "clip gradients to this global norm (0: off)")
      ->check(kNonNegative);
  auto* no_allreduce =
      app.add_flag("--no-allreduce", cfg.no_allreduce, "every step inside no_sync(): no gradient communication (throughput ceiling)");
  app.add_flag("--lockstep", cfg.lockstep,
               "with --no-allreduce: the ranks still wait for each other once per step (a barrier after backward, no "
               "gradient traffic), so the throughput of ranks that move in lockstep, what any synchronous step costs")
      ->needs(no_allreduce);
  app.add_option("--warmup-timing-steps", cfg.timing_skip, "steps excluded from the throughput figure")
      ->check(kNonNegative);
  app.add_flag("--log-losses", cfg.log_losses, "print every step's loss on rank 0 (LOSS step=N value=X)");
  app.add_option("--fault-kill-rank", cfg.fault_rank, "fault injection: this rank kills itself (SIGKILL) ...");
  app.add_option("--fault-at-step", cfg.fault_step,
                 "... right after this training step (first attempt only: not after a restart)");
  app.add_option("--fault-signal", cfg.fault_signal,
                 "... with this signal: KILL (a crash), or TERM (a stop request that reaches this rank alone; with "
                 "--checkpoint-dir every rank stops after the same step and saves it)")
      ->check(CLI::IsMember({"KILL", "TERM"}));
  CLI11_PARSE(app, argc, argv);
  if (cfg.optimizer == "adamw") {  // AdamW's usual settings unless given
    if (lr->count() == 0) cfg.base_lr = 1e-3;
    if (wd->count() == 0) cfg.weight_decay = 1e-2;
  }

  try {
    return train(cfg);
  } catch (const cohort::Error& e) {
    std::fprintf(stderr, "fashion_mnist: error: %s\n", e.what());
    return 1;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "fashion_mnist: torch error: %s\n", e.what_without_backtrace());
    return 1;
  }
}
