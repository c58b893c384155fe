#include "train.hpp"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>
#include <torch/version.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <tuple>

#include "cohort/cohort.hpp"
#include "cohort/data.hpp"
#include "cohort/torch.hpp"
#include "cohort/torch_train.hpp"
#include "model.hpp"

namespace {

using Clock = std::chrono::steady_clock;
double secs(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// Augmentation decided by (seed, epoch, sample) alone, so a resumed run sees
// exactly the images an uninterrupted one would.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

void augment(float* img, uint64_t r, float background, bool shift) {
  float tmp[28 * 28];
  const bool flip = r & 1;
  const int dx = shift ? static_cast<int>((r >> 1) % 5) - 2 : 0, dy = shift ? static_cast<int>((r >> 4) % 5) - 2 : 0;
  for (int y = 0; y < 28; ++y)
    for (int x = 0; x < 28; ++x) {
      int sx = (flip ? 27 - x : x) - dx, sy = y - dy;
      tmp[y * 28 + x] = (sx < 0 || sx >= 28 || sy < 0 || sy >= 28) ? background : img[sy * 28 + sx];
    }
  std::copy(tmp, tmp + 28 * 28, img);
}

struct Model {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(torch::Tensor)> forward;
};

Model make_model(const std::string& name) {
  if (name == "mlp") {
    Mlp m;
    return {m.ptr(), [m](torch::Tensor x) mutable { return m->forward(x); }};
  }
  Cnn m;
  return {m.ptr(), [m](torch::Tensor x) mutable { return m->forward(x); }};
}

double evaluate(Model& model, const cohort::data::FashionMnist& test, cohort::ProcessGroup& pg, const torch::Device& device) {
  torch::NoGradGuard no_grad;
  model.module->eval();
  const int64_t n = test.size();
  int64_t correct = 0;
  std::vector<float> x;
  std::vector<int64_t> y;
  // Rank r takes samples r, r + world, ...: every sample exactly once.
  std::vector<int64_t> mine;
  for (int64_t i = pg.rank(); i < n; i += pg.size()) mine.push_back(i);
  for (size_t start = 0; start < mine.size(); start += 1000) {
    size_t b = std::min<size_t>(1000, mine.size() - start);
    x.resize(b * 784);
    y.resize(b);
    for (size_t k = 0; k < b; ++k) test.get(mine[start + k], x.data() + k * 784, y.data() + k);
    auto out = model.forward(torch::from_blob(x.data(), {static_cast<int64_t>(b), 1, 28, 28}).to(device));
    correct += out.argmax(1)
                   .eq(torch::from_blob(y.data(), {static_cast<int64_t>(b)}, torch::kLong).to(device))
                   .sum()
                   .item<int64_t>();
  }
  model.module->train();
  return cohort::torch::allreduce_scalar(pg, static_cast<double>(correct)) / static_cast<double>(n);
}

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

std::string eta(double s) { return fmt::format("{}:{:02d}", static_cast<int>(s) / 60, static_cast<int>(s) % 60); }

}  // namespace

int train(const TrainConfig& cfg) {
  torch::set_num_threads(cfg.threads);
  torch::manual_seed(cfg.seed);
  auto pg = cohort::init_process_group();
  const int world = pg->size(), rank = pg->rank();
  const bool lead = rank == 0;
  const torch::Device device = pick_device(cfg.device, *pg);
  if (cfg.fp16_autocast && !device.is_cuda())
    throw cohort::InvalidArgument(fmt::format("--fp16-autocast runs on a GPU (--device cuda), not on {}; HINT: on the "
                                              "CPU use --bf16-autocast",
                                              device.str()));
  if (lead && device.is_cuda())
    std::printf("device: %s on every rank (%s backend)\n", device.str().c_str(), pg->backend_name().c_str());

  cohort::data::FashionMnistOptions tro, teo;
  tro.dir = teo.dir = cfg.data_dir;
  teo.train = false;
  // The reader's message names the file and what is wrong with it; the flag is this program's.
  const auto load = [&](const cohort::data::FashionMnistOptions& o) {
    try {
      return cohort::data::FashionMnist(o);
    } catch (const cohort::IoError& e) {
      throw cohort::IoError(fmt::format("{} (this program reads --data-dir, here {}; Debian's dataset-fashion-mnist "
                                        "package installs the files in /usr/share/datasets/fashion-mnist)",
                                        e.what(), cfg.data_dir));
    }
  };
  cohort::data::FashionMnist train_set = load(tro), test_set = load(teo);

  Model model = make_model(cfg.model);
  model.module->to(device);  // before the optimizer takes the parameters
  const double peak_lr = cohort::torch::scaled_lr(cfg.base_lr, world);
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::function<void()> optimizer_step;  // cohort's fused step or the optimizer's own
  auto use = [&](auto owned, auto fused_step) {
    optimizer_step = [o = owned.get(), fused_step, fused = cfg.optimizer_step == "fused"] {
      if (fused)
        fused_step(*o);
      else
        o->step();
    };
    optimizer = std::move(owned);
  };
  if (cfg.optimizer == "adamw")
    use(std::make_unique<torch::optim::AdamW>(model.module->parameters(),
                                              torch::optim::AdamWOptions(peak_lr).weight_decay(cfg.weight_decay)),
        cohort::torch::adamw_step);
  else
    use(std::make_unique<torch::optim::SGD>(
            model.module->parameters(), torch::optim::SGDOptions(peak_lr).momentum(cfg.momentum).weight_decay(cfg.weight_decay)),
        cohort::torch::sgd_step);
  torch::optim::Optimizer& opt = *optimizer;
  // fp16 autocast: the loss is scaled before backward so small gradients do
  // not underflow in fp16; the scaler skips a step whose gradients overflowed.
  // Its scale and growth tracker are saved with the schedule (exact resume).
  cohort::torch::GradScaler scaler({.enabled = cfg.fp16_autocast});

  cohort::data::SamplerOptions so;
  so.num_replicas = world;
  so.rank = rank;
  so.seed = cfg.seed;
  const int64_t train_n = cfg.train_limit > 0 ? std::min(cfg.train_limit, train_set.size()) : train_set.size();
  cohort::data::DistributedSampler sampler(train_n, so);
  const int64_t steps_per_epoch = (sampler.size() + cfg.batch_size - 1) / cfg.batch_size;
  const int64_t total_steps = steps_per_epoch * cfg.epochs;

  // ---- resume ----
  // A restart by the launcher (TORCHELASTIC_RESTART_COUNT > 0) continues from
  // the newest valid checkpoint unless --no-auto-resume: the work since that
  // checkpoint is all a failure costs.
  const char* restart_env = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const int restart_count = restart_env != nullptr ? std::atoi(restart_env) : 0;
  const bool resume = cfg.resume || (cfg.auto_resume && restart_count > 0);
  if (resume && !cfg.resume && lead) {
    if (cfg.ckpt_dir.empty())
      std::printf("auto-resume: restart %d, but no --checkpoint-dir: starting from scratch\n", restart_count);
    else
      std::printf(
          "auto-resume: restart %d (TORCHELASTIC_RESTART_COUNT), resuming from the newest valid checkpoint in "
          "%s (--no-auto-resume starts over)\n",
          restart_count, cfg.ckpt_dir.c_str());
  }
  int64_t step = 0, start_epoch = 0, position = 0;
  int64_t schedule_offset = 0;  // the LR schedule's step is step + this (non-zero after a world-size change)
  // The job's id, the same in every restart (cohort run's COHORT_RUN_ID, else
  // torchrun's TORCHELASTIC_RUN_ID): saved with each checkpoint, so that a
  // restart resumes this job's checkpoints only, never an earlier run's left
  // in the same directory (which may have a higher step).
  const char* run_env = std::getenv("COHORT_RUN_ID") ? std::getenv("COHORT_RUN_ID") : std::getenv("TORCHELASTIC_RUN_ID");
  const std::string run_id = run_env != nullptr ? run_env : "";
  if (!resume && !cfg.ckpt_dir.empty() && lead) {
    const auto steps = cohort::list_checkpoint_steps(cfg.ckpt_dir);
    if (!steps.empty())
      std::printf("note: --checkpoint-dir %s holds checkpoints of an earlier run (newest: step %lld); this run saves "
                  "beside them and a restart resumes only its own (pass --resume to continue that run instead)\n",
                  cfg.ckpt_dir.c_str(), static_cast<long long>(steps.back()));
  }
  if (resume && !cfg.ckpt_dir.empty()) {
    // Rank 0 picks the checkpoint; everyone loads that one (the directory must be visible to every rank).
    const cohort::LoadOptions lopts{.required_files = {"model", "optimizer"}};
    std::string chosen;
    if (lead) {
      // --resume: the newest valid checkpoint. A restart: the newest of this job's.
      auto latest = cohort::load_latest_valid(cfg.ckpt_dir, lopts);
      if (latest) {
        for (const auto& s : latest->skipped) std::printf("resume: skipped %s\n", s.c_str());
        if (cfg.resume || run_id.empty()) {
          chosen = latest->path;
        } else {
          const auto steps = cohort::list_checkpoint_steps(cfg.ckpt_dir);
          for (auto at = steps.rbegin(); at != steps.rend() && chosen.empty(); ++at) {
            if (*at > latest->step) continue;
            try {
              auto c = *at == latest->step ? std::move(*latest)
                                           : cohort::load_checkpoint(fmt::format("{}/step_{:09d}", cfg.ckpt_dir, *at), lopts);
              if (nlohmann::json::parse(c.manifest.config).value("run", std::string()) == run_id)
                chosen = c.path;
              else
                std::printf("resume: skipped %s: written by another run\n", c.path.c_str());
            } catch (const cohort::IoError& e) {
              std::printf("resume: skipped step %lld: %s\n", static_cast<long long>(*at), e.what());
            }
          }
        }
      }
    }
    chosen = cohort::torch::broadcast_string(*pg, chosen, 0);
    if (!chosen.empty()) {
      auto ck = cohort::load_checkpoint(chosen, lopts);
      // What fixes the data order and the step count, and what the saved state
      // belongs to, must be the same as when the checkpoint was written, or the
      // run would not continue where it stopped.
      const auto saved = nlohmann::json::parse(ck.manifest.config, nullptr, false);
      const auto show = [](const nlohmann::json& j) { return j.is_string() ? j.get<std::string>() : j.dump(); };
      // `what` shows a value ("--seed {}"); `flag` is the option that sets it.
      const auto differs = [&](const char* key, const auto& now, const char* what, const char* flag, const char* why) {
        if (!saved.is_object() || !saved.contains(key) || saved[key] == nlohmann::json(now)) return;
        const std::string then = fmt::format(fmt::runtime(what), show(saved[key]));
        throw cohort::InvalidArgument(fmt::format(
            "cannot resume from {}: it was written with {}, this run has {}, so {}; HINT: resume with the same {} ({}), "
            "or start a new run with another --checkpoint-dir",
            ck.path, then, fmt::format(fmt::runtime(what), show(nlohmann::json(now))), why, flag, then));
      };
      constexpr const char* kOrder = "the data order and the step count would not continue where that run stopped";
      differs("batch_size", cfg.batch_size, "--batch-size {}", "--batch-size", kOrder);
      differs("seed", cfg.seed, "--seed {}", "--seed", kOrder);
      differs("train_samples", train_n, "{} training samples", "--train-limit", kOrder);
      differs("model", cfg.model, "--model {}", "--model", "its weights do not fit this model");
      differs("optimizer", cfg.optimizer, "--optimizer {}", "--optimizer", "its optimizer state is another optimizer's");
      // The rest may change between runs (a lower learning rate after a divergence, ...): the
      // run goes on with this run's value, and says so.
      constexpr const char* kSchedule = "this run's learning-rate schedule";
      constexpr const char* kValue = "this run's value";
      if (lead && saved.is_object())
        for (const auto& [key, flag, now, goes_on_with] :
             {std::tuple{"epochs", "--epochs", nlohmann::json(cfg.epochs), kSchedule},
              std::tuple{"base_lr", "--lr", nlohmann::json(cfg.base_lr), kSchedule},
              std::tuple{"warmup_steps", "--warmup-steps", nlohmann::json(cfg.warmup_steps), kSchedule},
              std::tuple{"momentum", "--momentum", nlohmann::json(cfg.momentum), kValue},
              std::tuple{"weight_decay", "--weight-decay", nlohmann::json(cfg.weight_decay), kValue},
              std::tuple{"augment", "--augment", nlohmann::json(cfg.augment), kValue},
              std::tuple{"clip_grad_norm", "--clip-grad-norm", nlohmann::json(cfg.clip_grad_norm), kValue},
              std::tuple{"comm_hook", "--comm-hook", nlohmann::json(cfg.comm_hook), kValue},
              std::tuple{"bf16_autocast", "--bf16-autocast", nlohmann::json(cfg.bf16_autocast), kValue},
              std::tuple{"fp16_autocast", "--fp16-autocast", nlohmann::json(cfg.fp16_autocast), kValue},
              std::tuple{"device", "--device", nlohmann::json(device.str()), kValue}})
          if (saved.contains(key) && saved[key] != now)
            std::printf("resume: the checkpoint was written with %s %s, this run has %s: the run continues with %s\n", flag,
                        show(saved[key]).c_str(), show(now).c_str(), goes_on_with);
      cohort::torch::load_module_state(*model.module, ck.files.at("model"));
      cohort::torch::load_optimizer_state(opt, ck.files.at("optimizer"));
      step = ck.step;
      start_epoch = ck.manifest.epoch;
      position = ck.manifest.sampler_position;
      // The schedule's own step (it differs from `step` after an earlier change of world size).
      if (auto sched = nlohmann::json::parse(ck.manifest.lr_schedule, nullptr, false); sched.is_object()) {
        schedule_offset = sched.value("step", step) - step;
        if (cfg.fp16_autocast && sched.contains("grad_scale"))
          scaler.load(sched.value("grad_scale", scaler.current_scale()), sched.value("growth_tracker", 0));
      }
      if (ck.manifest.world_size != world) {
        // Every rank of the old world took sampler_position samples of the
        // epoch's permutation, together its first sampler_position x old world
        // entries; here each rank skips its share of those (a few may repeat).
        // The LR schedule continues from the same point of the run.
        const int64_t seen = position * ck.manifest.world_size;
        position = std::min<int64_t>(seen / world, sampler.size());
        schedule_offset = start_epoch * steps_per_epoch + (position + cfg.batch_size - 1) / cfg.batch_size - step;
        if (lead)
          std::printf("resume: the checkpoint was written by %d ranks, this run has %d: the epoch continues after its "
                      "first %lld samples, the learning-rate schedule at its step %lld of %lld\n",
                      ck.manifest.world_size, world, static_cast<long long>(seen),
                      static_cast<long long>(step + schedule_offset), static_cast<long long>(total_steps));
      }
      if (auto it = ck.manifest.rng_states.find("torch_cpu"); it != ck.manifest.rng_states.end())
        cohort::torch::set_cpu_rng_state(it->second);
      if (lead)
        std::printf("resumed from %s: epoch %lld, step %lld, sample %lld of the epoch\n", ck.path.c_str(),
                    static_cast<long long>(start_epoch), static_cast<long long>(step), static_cast<long long>(position));
    } else if (lead) {
      std::printf("resume: no valid checkpoint in %s, starting from scratch\n", cfg.ckpt_dir.c_str());
    }
  }

  cohort::torch::DistributedDataParallelOptions dopts;
  dopts.bucket_cap_mb = cfg.bucket_cap_mb;
  dopts.first_bucket_mb = cfg.first_bucket_mb;
  // A GPU module on a host backend (native) stages its gradients through host
  // buckets: .grad cannot be a view of them.
  dopts.gradient_as_bucket_view = cfg.grad_bucket_view && !(device.is_cuda() && pg->cuda_device() < 0);
  if (lead && cfg.grad_bucket_view && !dopts.gradient_as_bucket_view)
    std::printf("note: gradients are staged through host buckets (a GPU module on the %s backend): "
                "gradient_as_bucket_view is off\n",
                pg->backend_name().c_str());
  dopts.reduce_at_world_size_1 = cfg.reduce_at_world_size_1;
  dopts.wait_on_stream = cfg.ddp_wait_on_stream;
  if (cfg.comm_hook == "fp16") dopts.comm_hook = cohort::ddp::fp16_compress_hook();
  if (cfg.comm_hook == "bf16") dopts.comm_hook = cohort::ddp::bf16_compress_hook();
  // --no-ddp (one rank only): the same program without DDP, the baseline DDP's overhead is measured against.
  std::optional<cohort::torch::DistributedDataParallel> ddp;
  if (cfg.no_ddp && world > 1)
    throw cohort::InvalidArgument(fmt::format("--no-ddp trains one replica; this job has {} ranks (run it with "
                                              "--nproc-per-node 1)",
                                              world));
  if (!cfg.no_ddp) ddp.emplace(model.module, pg, dopts);
  auto params = model.module->parameters();

  auto save = [&](int64_t epoch, int64_t pos) {
    if (cfg.ckpt_dir.empty()) return;
    // Every rank's last step is complete and its gradient collectives did not
    // fail before rank 0 writes (with DDP's stream-ordered wait a failure
    // would otherwise show only at the next collective).
    pg->barrier()->wait();
    if (lead) {
      cohort::Manifest m;
      m.epoch = epoch;
      m.sampler_position = pos;
      m.world_size = world;
      m.rng_states["torch_cpu"] = cohort::torch::cpu_rng_state();
      nlohmann::json schedule{{"step", step + schedule_offset}, {"peak", peak_lr}, {"warmup", cfg.warmup_steps}, {"total", total_steps}};
      if (cfg.fp16_autocast) {
        schedule["grad_scale"] = scaler.current_scale();
        schedule["growth_tracker"] = scaler.growth_tracker();
      }
      m.lr_schedule = schedule.dump();
      m.config = nlohmann::json{{"model", cfg.model}, {"epochs", cfg.epochs}, {"batch_size", cfg.batch_size}, {"base_lr", cfg.base_lr},
                                {"optimizer", cfg.optimizer}, {"momentum", cfg.momentum}, {"weight_decay", cfg.weight_decay},
                                {"warmup_steps", cfg.warmup_steps}, {"augment", cfg.augment}, {"clip_grad_norm", cfg.clip_grad_norm},
                                {"comm_hook", cfg.comm_hook}, {"bf16_autocast", cfg.bf16_autocast},
                                {"fp16_autocast", cfg.fp16_autocast}, {"device", device.str()}, {"seed", cfg.seed},
                                {"train_samples", train_n}, {"world_size", world}, {"run", run_id}}.dump();
      const auto started = Clock::now();
      const std::string path = cohort::save_checkpoint(
          cfg.ckpt_dir, step, {{"model", cohort::torch::module_state(*model.module)}, {"optimizer", cohort::torch::optimizer_state(opt)}},
          m, {.keep_last = cfg.keep});
      std::printf("checkpoint: step %lld saved to %s (%.0f ms)\n", static_cast<long long>(step), path.c_str(),
                  secs(started, Clock::now()) * 1000);
      std::fflush(stdout);
    }
    pg->barrier()->wait();
  };

  // ---- train ----
  // Step breakdown (compute / exposed communication / data wait) and the timeline's "train" track.
  cohort::StepMetrics metrics(*pg);
  int64_t timed_steps = 0;
  double timed_s = 0;
  bool stop = false;
  double final_acc = 0;     // the last test accuracy measured,
  int64_t final_epoch = 0;  // in this epoch (0: none),
  int64_t final_step = 0;   // after this step,
  bool final_partial = false;  // part-way through the epoch (--max-steps with --eval-at-stop)
  for (int64_t epoch = start_epoch; epoch < cfg.epochs && !stop; ++epoch) {
    sampler.set_epoch(epoch);
    auto idx = sampler.indices();
    idx.erase(idx.begin(), idx.begin() + std::min<int64_t>(position, static_cast<int64_t>(idx.size())));
    int64_t pos = position;
    position = 0;
    cohort::data::LoaderOptions lo;
    lo.batch_size = cfg.batch_size;
    const float background = (0.0f - 0.2860f) / 0.3530f;
    const bool shift = cfg.augment == "flip+shift";
    if (cfg.augment != "none")
      lo.transform = [&, epoch](int64_t index, float* x, int64_t*) {
        augment(x, mix(cfg.seed * 1000003u + static_cast<uint64_t>(epoch) * 7919u + static_cast<uint64_t>(index)), background, shift);
      };
    cohort::data::Loader loader(train_set, std::move(idx), lo);
    auto epoch_start = Clock::now(), last_print = epoch_start;
    int64_t pos_at_print = pos;  // the progress line's images/s: since the previous line, every rank's images
    double loss_sum = 0;
    int64_t loss_n = 0;
    for (;;) {
      metrics.begin_step();
      auto batch = loader.next();  // waiting for it: "data" on the timeline, data wait in the metrics
      if (!batch) {
        metrics.cancel_step();
        break;
      }
      metrics.data_ready();
      auto t0 = Clock::now();
      const int64_t b = batch->size();
      auto x = torch::from_blob(batch->x.data(), {b, 1, 28, 28}).to(device);
      auto y = torch::from_blob(batch->y.data(), {b}, torch::kLong).to(device);
      opt.param_groups()[0].options().set_lr(cohort::torch::warmup_cosine_lr(step + schedule_offset, cfg.warmup_steps, total_steps, peak_lr));
      cohort::torch::zero_grad(opt);  // set to none: backward hands over fresh gradients (no zeroing pass)
      if (ddp) ddp->pre_forward();
      torch::Tensor loss;
      std::optional<cohort::timeline::Span> forward_span(std::in_place, "forward");
      if (cfg.bf16_autocast || cfg.fp16_autocast) {
        // A half-precision forward; the loss and backward in float32.
        cohort::torch::Autocast autocast(cfg.fp16_autocast ? torch::kHalf : torch::kBFloat16, true, device.type());
        loss = torch::cross_entropy_loss(model.forward(x).to(torch::kFloat), y);
      } else {
        loss = torch::cross_entropy_loss(model.forward(x), y);
      }
      forward_span.reset();
      std::optional<cohort::timeline::Span> backward_span(std::in_place, "backward");  // includes DDP's finalize()
      const torch::Tensor scaled = scaler.scale(loss);  // the loss itself without --fp16-autocast
      if (cfg.no_allreduce) {
        if (ddp) {
          auto guard = ddp->no_sync();
          scaled.backward();
        } else {
          scaled.backward();
        }
        if (cfg.lockstep) {
          cohort::timeline::Span span("lockstep barrier");
          pg->barrier()->wait();
        }
      } else {
        scaled.backward();
      }
      backward_span.reset();
      if (cfg.fp16_autocast && cfg.clip_grad_norm > 0) scaler.unscale(opt, pg.get());  // clip the true gradients
      if (cfg.clip_grad_norm > 0) cohort::torch::clip_grad_norm(params, cfg.clip_grad_norm);
      {
        cohort::timeline::Span span("optimizer step");
        if (cfg.fp16_autocast)
          scaler.step(opt, pg.get());  // skipped on every rank when a gradient overflowed
        else
          optimizer_step();
      }
      ++step;
      pos += b;
      const double loss_value = loss.item<double>();
      loss_sum += loss_value;
      if (cfg.log_losses && lead) {
        std::printf("LOSS step=%lld value=%.7f\n", static_cast<long long>(step), loss_value);
        std::fflush(stdout);  // a line per step as it happens (bench/fault_times.py times them)
      }
      ++loss_n;
      metrics.end_step();
      auto t1 = Clock::now();
      if (step > cfg.timing_skip) {
        timed_s += secs(t0, t1);
        ++timed_steps;
      }
      if (lead && (secs(last_print, t1) > 2.0 || pos >= sampler.size())) {
        double done = static_cast<double>(pos) / sampler.size();
        double rate = static_cast<double>(world * (pos - pos_at_print)) / std::max(1e-9, secs(last_print, t1));
        last_print = t1;
        pos_at_print = pos;
        int bars = static_cast<int>(done * 20);
        std::printf("epoch %lld/%d [%s%s] step %lld/%lld loss %.4f %.0f img/s ETA %s\n", static_cast<long long>(epoch + 1),
                    cfg.epochs, std::string(bars, '#').c_str(), std::string(20 - bars, '.').c_str(),
                    static_cast<long long>((pos + cfg.batch_size - 1) / cfg.batch_size), static_cast<long long>(steps_per_epoch),
                    loss_sum / loss_n, rate, eta(secs(epoch_start, t1) / std::max(done, 1e-9) * (1 - done)).c_str());
        std::fflush(stdout);
      }
      // At the epoch's last step the save after the epoch (epoch + 1, position 0) follows: one save, not two of one step.
      if (cfg.ckpt_every > 0 && step % cfg.ckpt_every == 0 && pos < sampler.size()) save(epoch, pos);
      if (rank == cfg.fault_rank && step == cfg.fault_step && restart_count == 0) {
        std::fflush(stdout);
        raise(SIGKILL);
      }
      if (cfg.max_steps > 0 && step >= cfg.max_steps) {
        stop = true;
        break;
      }
    }
    double epoch_s = secs(epoch_start, Clock::now());
    double train_loss = cohort::torch::allreduce_scalar(*pg, loss_n ? loss_sum / loss_n : 0.0) / world;
    const bool cut_short = stop && pos < sampler.size();  // --max-steps ended the epoch early
    if (cut_short && !cfg.eval_at_stop) break;
    double acc = evaluate(model, test_set, *pg, device);
    final_acc = acc;
    final_epoch = epoch + 1;
    final_step = step;
    final_partial = cut_short;
    if (lead) {
      if (cut_short)
        std::printf("stopped at step %lld (--max-steps), part-way through the epoch\n", static_cast<long long>(step));
      std::printf("epoch %lld: test accuracy %.2f%% (train loss %.4f, %.1f s)\n", static_cast<long long>(epoch + 1), acc * 100,
                  train_loss, epoch_s);
      std::printf("RESULT ddp model=%s world=%d epoch=%lld epoch_time_s=%.2f train_loss=%.4f test_acc=%.4f\n", cfg.model.c_str(),
                  world, static_cast<long long>(epoch + 1), epoch_s, train_loss, acc);
      std::fflush(stdout);
    }
    if (cut_short) break;
    save(epoch + 1, 0);
  }
  double slowest = cohort::torch::allreduce_scalar(*pg, timed_s, cohort::ReduceOp::Max);
  if (lead) {
    double ips = timed_steps > 0 ? world * cfg.batch_size * timed_steps / slowest : 0;
    int64_t nparams = 0;
    for (auto& p : params) nparams += p.numel();
    std::printf("RESULT ddp_summary model=%s world=%d params=%lld steps=%lld timed_steps=%lld imgs_per_s=%.1f ms_per_step=%.2f allreduce=%s\n",
                cfg.model.c_str(), world, static_cast<long long>(nparams), static_cast<long long>(step),
                static_cast<long long>(timed_steps), ips, timed_steps ? slowest / timed_steps * 1000 : 0.0,
                cfg.no_allreduce ? (cfg.lockstep ? "off+barrier" : "off") : "on");
  }
  metrics.finish();
  if (lead) std::fputs(metrics.report().c_str(), stdout);
  if (lead && final_epoch > 0 && final_step == step)
    std::printf("final test accuracy: %.2f%% after %sepoch %lld of %d (step %lld), %d rank%s\n", final_acc * 100,
                final_partial ? "part of " : "", static_cast<long long>(final_epoch), cfg.epochs,
                static_cast<long long>(step), world, world == 1 ? "" : "s");
  else if (lead && final_epoch > 0)
    std::printf("last measured test accuracy: %.2f%% after epoch %lld (step %lld); the run stopped at step %lld "
                "without measuring it again (--eval-at-stop does)\n",
                final_acc * 100, static_cast<long long>(final_epoch), static_cast<long long>(final_step),
                static_cast<long long>(step));
  pg->shutdown();
  return 0;
}
