// The Fashion-MNIST example's configuration (main() fills it from the flags)
// and its training program, train() (train.cpp: an outline of the parts in
// parts.hpp, which users copy one at a time).
#pragma once

#include <cstdint>
#include <string>

struct TrainConfig {
  std::string model = "cnn";
  int epochs = 2;
  int64_t train_limit = 0;  // use only the first N training images (0: all 60000)
  int batch_size = 64;
  std::string optimizer = "sgd";  // sgd (momentum) or adamw
  double base_lr = 0.03;          // main() sets 1e-3 for adamw unless --lr was given
  double momentum = 0.9;          // sgd only
  double weight_decay = 5e-4;     // main() sets 1e-2 for adamw unless --weight-decay was given
  std::string optimizer_step = "fused";  // fused: cohort::torch::sgd_step / adamw_step; libtorch: the optimizer's step()
  int warmup_steps = 200;
  uint64_t seed = 42;
  std::string augment = "flip";  // none, flip, flip+shift
  int threads = 1;
  int64_t max_steps = 0;
  bool eval_at_stop = false;  // measure the test accuracy also when --max-steps stops mid-epoch
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  std::string ckpt_dir;
  int64_t ckpt_every = 0;
  int keep = 3;
  bool resume = false;
  bool auto_resume = true;  // resume by itself when TORCHELASTIC_RESTART_COUNT > 0 (a restart by `cohort run`)
  std::string comm_hook = "allreduce";
  int powersgd_rank = 4;            // --comm-hook powersgd: the approximation rank
  int64_t powersgd_start_iter = 10;  // ... and the plain iterations before it compresses
  double bucket_cap_mb = 25.0;
  double first_bucket_mb = 1.0;
  bool grad_bucket_view = true;  // .grad views the DDP buckets: no copies in or out
  bool bf16_autocast = false;
  bool fp16_autocast = false;  // CUDA only, with a GradScaler
  std::string shard = "none";  // none (DDP), zero1 or zero2 (cohort::torch::ZeroOptimizer), fsdp
  bool cpu_offload = false;  // --shard fsdp on a GPU: shards and the optimizer step in host memory
  std::string param_dtype = "fp32";  // --shard fsdp: the dtype units are gathered and compute in (bf16: mixed precision)
  bool no_ddp = false;  // one rank, no DistributedDataParallel: the baseline for DDP's overhead
  std::string device = "auto";  // cpu, cuda (GPU LOCAL_RANK, or the nccl group's), auto (cuda on the nccl backend)
  bool reduce_at_world_size_1 = false;  // DDP's reducer runs even alone (as PyTorch's does)
  bool ddp_wait_on_stream = false;      // DistributedDataParallelOptions::wait_on_stream
  double clip_grad_norm = 0.0;
  bool no_allreduce = false;
  bool lockstep = false;  // with no_allreduce: a barrier per step (ranks in lockstep, no gradient traffic)
  int timing_skip = 20;
  bool log_losses = false;     // print every step's loss (tests compare resumed runs with this)
  int fault_rank = -1;         // fault injection for tests: this rank signals itself ...
  int64_t fault_step = -1;     // ... right after this step, on the first attempt only (restart count 0) ...
  std::string fault_signal = "KILL";  // ... with SIGKILL (a crash) or SIGTERM (a stop request to this rank alone)
};

// Returns the process exit code.
int train(const TrainConfig& cfg);
