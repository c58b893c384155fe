// Setting up one rank: the device it trains on, the data, the model, the
// optimizer and DistributedDataParallel. train() calls them in this order:
// the model moves to its device before the optimizer takes its parameters,
// and DDP comes after a resume has loaded the weights (it broadcasts rank 0's).
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>
#include <torch/version.h>

#include <cstdio>
#include <cstdlib>
#include <optional>

#include "model.hpp"
#include "parts.hpp"

// --device: the CPU, or this rank's GPU (the nccl group's, else GPU
// LOCAL_RANK modulo the visible ones). auto: the GPU on a group that moves
// GPU memory (nccl), else the CPU; a GPU module on the native backend is
// staged through host memory, which only --device cuda asks for. Refused with the reason and the fix
// when LibTorch has no CUDA, no GPU is visible, or the backend cannot move
// the device's memory.
torch::Device pick_device(const std::string& want, const cohort::ProcessGroup& pg) {
  const bool cuda_built = c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA);
  const int gpus = cuda_built ? static_cast<int>(torch::cuda::device_count()) : 0;
  const int group_gpu = pg.cuda_device();
  if (want == "cpu" || (want == "auto" && group_gpu < 0)) {
    if (group_gpu >= 0)
      throw cohort::InvalidArgument(fmt::format(
          "--device cpu, but the {} backend moves GPU memory only; HINT: --device cuda, or COHORT_BACKEND=native "
          "to train on the CPU",
          pg.backend_name()));
    return torch::kCPU;
  }
  if (!cuda_built)
    throw cohort::InvalidArgument(fmt::format(
        "--device {}: this program's LibTorch ({}) was built without CUDA; HINT: build cohort against a CUDA "
        "LibTorch (cmake -DCOHORT_LIBTORCH=<its folder>, docs/gpu.md), or use --device cpu",
        want, TORCH_VERSION));
  if (gpus == 0) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    throw cohort::InvalidArgument(fmt::format(
        "--device {}: rank {} sees no CUDA GPU (torch::cuda::device_count() is 0; CUDA_VISIBLE_DEVICES={}); HINT: "
        "run it on a machine with a GPU (nvidia-smi lists them), fix CUDA_VISIBLE_DEVICES, or use --device cpu",
        want, pg.rank(), visible != nullptr ? fmt::format("'{}'", visible) : std::string("unset")));
  }
  const char* local = std::getenv("LOCAL_RANK");
  const int index = group_gpu >= 0 ? group_gpu : (local != nullptr ? std::atoi(local) : 0) % gpus;
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
}

cohort::data::FashionMnist load_fashion_mnist(const std::string& dir, bool train) {
  cohort::data::FashionMnistOptions o;
  o.dir = dir;
  o.train = train;
  // The reader's message names the file and what is wrong with it; the flag is this program's.
  try {
    return cohort::data::FashionMnist(o);
  } catch (const cohort::IoError& e) {
    throw cohort::IoError(fmt::format("{} (this program reads --data-dir, here {}; Debian's dataset-fashion-mnist "
                                      "package installs the files in /usr/share/datasets/fashion-mnist)",
                                      e.what(), dir));
  }
}

Model make_model(const std::string& name, const torch::Device& device,
                 const std::shared_ptr<cohort::ProcessGroup>& shard_group) {
  if (shard_group && device.is_cuda() && shard_group->cuda_device() < 0)
    throw cohort::InvalidArgument(fmt::format(
        "--shard fsdp with --device {} needs the nccl backend (this run's is {}): FSDP keeps a GPU model's shards "
        "on the GPU and gathers them with NCCL; HINT: COHORT_BACKEND=nccl, or --device cpu",
        device.str(), shard_group->backend_name()));
  // Under --shard fsdp each layer is sharded as it is built (onto the nccl
  // group's GPU); the rest follows with module->to(device) below.
  std::optional<cohort::torch::FsdpShardedInit> sharded;
  if (shard_group) sharded.emplace(shard_group);
  Model model;
  if (name == "big-mlp") {
    BigMlp m;
    model = {m.ptr(), [m](torch::Tensor x) mutable { return m->forward(x); }};
  } else if (name == "mlp") {
    Mlp m;
    model = {m.ptr(), [m](torch::Tensor x) mutable { return m->forward(x); }};
  } else {
    Cnn m;
    model = {m.ptr(), [m](torch::Tensor x) mutable { return m->forward(x); }};
  }
  sharded.reset();
  model.module->to(device);
  return model;
}

Optimizer make_optimizer(const TrainConfig& cfg, const std::vector<torch::Tensor>& params, double lr) {
  Optimizer made;
  auto use = [&](auto owned, auto fused_step) {
    made.step = [o = owned.get(), fused_step, fused = cfg.optimizer_step == "fused"] {
      if (fused)
        fused_step(*o);
      else
        o->step();
    };
    made.optimizer = std::move(owned);
  };
  if (cfg.optimizer == "adamw")
    use(std::make_unique<torch::optim::AdamW>(params,
                                              torch::optim::AdamWOptions(lr).weight_decay(cfg.weight_decay)),
        cohort::torch::adamw_step);
  else
    use(std::make_unique<torch::optim::SGD>(
            params, torch::optim::SGDOptions(lr).momentum(cfg.momentum).weight_decay(cfg.weight_decay)),
        cohort::torch::sgd_step);
  return made;
}

std::unique_ptr<cohort::torch::FullyShardedDataParallel> make_fsdp(const TrainConfig& cfg, Model& model,
                                                                   const std::shared_ptr<cohort::ProcessGroup>& pg) {
  if (cfg.shard != "fsdp") {
    if (cfg.param_dtype != "fp32")
      throw cohort::InvalidArgument("--param-dtype is for --shard fsdp; HINT: for bf16 compute without FSDP use "
                                    "--bf16-autocast");
    if (cfg.cpu_offload)
      throw cohort::InvalidArgument("--cpu-offload is for --shard fsdp (with --device cuda); HINT: add --shard fsdp");
    return nullptr;
  }
  const auto refuse = [&](const char* flag, const char* why) {
    throw cohort::InvalidArgument(fmt::format("--shard fsdp does not run with {}: {}", flag, why));
  };
  if (cfg.no_ddp) refuse("--no-ddp", "FSDP is data parallel; drop one of them");
  if (cfg.no_allreduce) refuse("--no-allreduce", "each rank steps only its shard, so the gradients must be reduced");
  if (cfg.comm_hook != "allreduce") refuse("--comm-hook", "FSDP reduce-scatters at full precision");
  if (cfg.fp16_autocast)
    refuse("--fp16-autocast", "fp16 needs loss scaling, which this example does not do on FSDP's shards; use "
                              "--bf16-autocast or --param-dtype bf16");
  if (cfg.param_dtype == "bf16" && cfg.bf16_autocast)
    refuse("--bf16-autocast and --param-dtype bf16", "pick one: autocast casts per operation, --param-dtype bf16 "
                                                      "gathers the layers in bf16 already");
  cohort::torch::FsdpOptions opts;
  if (cfg.param_dtype == "bf16") opts.param_dtype = torch::kBFloat16;
  opts.cpu_offload = cfg.cpu_offload;  // (FSDP refuses it for a model on the CPU, naming why)
  auto fsdp = std::make_unique<cohort::torch::FullyShardedDataParallel>(model.module, pg, opts);
  model.forward = [f = fsdp.get(), forward = std::move(model.forward)](torch::Tensor x) {
    f->pre_forward();  // gathers the root unit (the last layer), broadcasts buffers
    return forward(std::move(x));
  };
  return fsdp;
}

std::unique_ptr<cohort::torch::ZeroOptimizer> make_zero(const TrainConfig& cfg, const Model& model,
                                                        const std::shared_ptr<cohort::ProcessGroup>& pg, double lr) {
  if (cfg.shard != "zero1" && cfg.shard != "zero2") return nullptr;
  const auto refuse = [&](const char* flag, const char* why) {
    throw cohort::InvalidArgument(fmt::format("--shard {} does not run with {}: {}", cfg.shard, flag, why));
  };
  if (cfg.no_ddp) refuse("--no-ddp", "ZeRO is data parallel; drop one of them");
  if (cfg.no_allreduce) refuse("--no-allreduce", "a sharded optimizer needs the reduced gradients to step");
  if (cfg.comm_hook != "allreduce") refuse("--comm-hook", "ZeRO reduce-scatters at full precision");
  if (cfg.optimizer_step != "fused") refuse("--optimizer-step libtorch", "the shard always takes the fused step");
  cohort::torch::ZeroOptions zo;
  zo.stage = cfg.shard == "zero1" ? cohort::torch::ZeroStage::One : cohort::torch::ZeroStage::Two;
  zo.bucket_cap_mb = cfg.bucket_cap_mb;
  zo.first_bucket_mb = cfg.first_bucket_mb;
  cohort::torch::ShardOptimizerOptions opt =
      cfg.optimizer == "adamw"
          ? cohort::torch::ShardOptimizerOptions(torch::optim::AdamWOptions(lr).weight_decay(cfg.weight_decay))
          : cohort::torch::ShardOptimizerOptions(
                torch::optim::SGDOptions(lr).momentum(cfg.momentum).weight_decay(cfg.weight_decay));
  return std::make_unique<cohort::torch::ZeroOptimizer>(model.module, pg, opt, zo);
}

std::shared_ptr<cohort::ddp::PowerSgdState> make_powersgd_state(const TrainConfig& cfg) {
  if (cfg.comm_hook != "powersgd") return nullptr;
  return std::make_shared<cohort::ddp::PowerSgdState>(
      cohort::ddp::PowerSgdOptions{.rank = cfg.powersgd_rank, .start_iter = cfg.powersgd_start_iter});
}

std::unique_ptr<cohort::torch::DistributedDataParallel> make_ddp(
    const TrainConfig& cfg, const Model& model, const std::shared_ptr<cohort::ProcessGroup>& pg,
    const torch::Device& device, const std::shared_ptr<cohort::ddp::PowerSgdState>& powersgd) {
  cohort::torch::DistributedDataParallelOptions dopts;
  dopts.bucket_cap_mb = cfg.bucket_cap_mb;
  dopts.first_bucket_mb = cfg.first_bucket_mb;
  // A GPU module on a host backend (native) stages its gradients through host
  // buckets: .grad cannot be a view of them.
  dopts.gradient_as_bucket_view = cfg.grad_bucket_view && !(device.is_cuda() && pg->cuda_device() < 0);
  if (pg->rank() == 0 && cfg.grad_bucket_view && !dopts.gradient_as_bucket_view)
    std::printf("note: gradients are staged through host buckets (a GPU module on the %s backend): "
                "gradient_as_bucket_view is off\n",
                pg->backend_name().c_str());
  dopts.reduce_at_world_size_1 = cfg.reduce_at_world_size_1;
  dopts.wait_on_stream = cfg.ddp_wait_on_stream;
  if (cfg.comm_hook == "fp16") dopts.comm_hook = cohort::ddp::fp16_compress_hook();
  if (cfg.comm_hook == "bf16") dopts.comm_hook = cohort::ddp::bf16_compress_hook();
  if ((cfg.comm_hook == "int8" || cfg.comm_hook == "powersgd") && pg->cuda_device() >= 0)
    throw cohort::InvalidArgument(fmt::format("--comm-hook {} compresses on the host; the {} backend reduces GPU "
                                              "buckets: use --comm-hook fp16 or bf16",
                                              cfg.comm_hook, pg->backend_name()));
  if (cfg.comm_hook == "int8") dopts.comm_hook = cohort::ddp::int8_compress_hook();
  if (cfg.comm_hook == "powersgd") dopts.comm_hook = cohort::ddp::powersgd_hook(powersgd ? powersgd : make_powersgd_state(cfg));
  // --no-ddp (one rank only): the same program without DDP, the baseline DDP's overhead is measured against.
  if (cfg.no_ddp && pg->size() > 1)
    throw cohort::InvalidArgument(fmt::format("--no-ddp trains one replica; this job has {} ranks (run it with "
                                              "--nproc-per-node 1)",
                                              pg->size()));
  if (cfg.no_ddp || cfg.shard != "none") return nullptr;
  return std::make_unique<cohort::torch::DistributedDataParallel>(model.module, pg, dopts);
}
