// The training loop: one step, one epoch, evaluation.
//
// train_step: the step's learning rate, gradients set to none, forward (in
// half precision under autocast), backward of the loss (scaled by the
// GradScaler under --fp16-autocast) while DDP averages the gradients,
// clipping, the optimizer step. Timeline spans "forward", "backward" (with
// DDP's finalize) and "optimizer step" on the "train" track.
//
// train_epoch: this rank's share of the epoch's permutation (the
// DistributedSampler's, less the samples a resume skips) through a
// prefetching loader, augmented by (seed, epoch, sample) alone so that a
// resumed run sees exactly the images an uninterrupted one would; one
// train_step per batch, timed by StepMetrics; rank 0's progress line; the
// periodic checkpoints; fault injection for the restart tests.
//
// evaluate: every test sample once across the ranks, the correct counts summed.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <optional>

#include "parts.hpp"

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

// This rank's batches of `epoch`, after the first `skip` of its samples (a
// resume part-way through the epoch), augmented as --augment asks.
cohort::data::Loader epoch_loader(const TrainConfig& cfg, const cohort::data::FashionMnist& train_set,
                                  cohort::data::DistributedSampler& sampler, int64_t epoch, int64_t skip) {
  sampler.set_epoch(epoch);
  auto idx = sampler.indices();
  idx.erase(idx.begin(), idx.begin() + std::min<int64_t>(skip, static_cast<int64_t>(idx.size())));
  cohort::data::LoaderOptions lo;
  lo.batch_size = cfg.batch_size;
  const float background = (0.0f - 0.2860f) / 0.3530f;  // a black pixel, normalised: what a shift brings in
  const bool shift = cfg.augment == "flip+shift";
  if (cfg.augment != "none")
    lo.transform = [seed = cfg.seed, epoch, background, shift](int64_t index, float* x, int64_t*) {
      augment(x, mix(seed * 1000003u + static_cast<uint64_t>(epoch) * 7919u + static_cast<uint64_t>(index)), background, shift);
    };
  return cohort::data::Loader(train_set, std::move(idx), lo);
}

// The batch's loss. Under --bf16-autocast or --fp16-autocast the forward runs
// in half precision; the loss, and so the backward from it, in float32.
torch::Tensor forward_loss(Model& model, const torch::Tensor& x, const torch::Tensor& y, const TrainConfig& cfg,
                           torch::DeviceType device) {
  if (cfg.bf16_autocast || cfg.fp16_autocast) {
    cohort::torch::Autocast autocast(cfg.fp16_autocast ? torch::kHalf : torch::kBFloat16, true, device);
    return torch::cross_entropy_loss(model.forward(x).to(torch::kFloat), y);
  }
  return torch::cross_entropy_loss(model.forward(x).to(torch::kFloat), y);  // (bf16 under --param-dtype bf16)
}

std::string eta(double s) { return fmt::format("{}:{:02d}", static_cast<int>(s) / 60, static_cast<int>(s) % 60); }

// Rank 0's progress line: one at most every 2 s, and one at the epoch's end.
// Its images/s counts every rank's images since the previous line.
class ProgressLine {
 public:
  ProgressLine(const TrainConfig& cfg, int world, int64_t epoch, int64_t per_rank_samples, int64_t position,
               Clock::time_point started)
      : cfg_(cfg), world_(world), epoch_(epoch), samples_(per_rank_samples), started_(started),
        last_print_(started), position_at_print_(position) {}

  // After a step that brought this rank to `position` of the epoch.
  void after_step(int64_t position, double loss_sum, int64_t loss_n, Clock::time_point now) {
    if (!(secs(last_print_, now) > 2.0 || position >= samples_)) return;
    double done = static_cast<double>(position) / samples_;
    double rate = static_cast<double>(world_ * (position - position_at_print_)) / std::max(1e-9, secs(last_print_, now));
    last_print_ = now;
    position_at_print_ = position;
    int bars = static_cast<int>(done * 20);
    std::printf("epoch %lld/%d [%s%s] step %lld/%lld loss %.4f %.0f img/s ETA %s\n", static_cast<long long>(epoch_ + 1),
                cfg_.epochs, std::string(bars, '#').c_str(), std::string(20 - bars, '.').c_str(),
                static_cast<long long>(batches(position, cfg_.batch_size)),
                static_cast<long long>(batches(samples_, cfg_.batch_size)), loss_sum / loss_n, rate,
                eta(secs(started_, now) / std::max(done, 1e-9) * (1 - done)).c_str());
    std::fflush(stdout);
  }

 private:
  const TrainConfig& cfg_;
  int world_;
  int64_t epoch_, samples_;
  Clock::time_point started_, last_print_;
  int64_t position_at_print_;
};

// train_step under --shard: the ZeroOptimizer clears, reduces, clips and
// steps (DDP's and the optimizer's parts of the step, on this rank's shard).
torch::Tensor zero_step(Trainer& t, const torch::Tensor& x, const torch::Tensor& y, double lr) {
  const TrainConfig& cfg = t.cfg;
  cohort::torch::ZeroOptimizer& opt = *t.zero;
  opt.set_lr(lr);
  opt.zero_grad();
  opt.pre_forward();
  std::optional<cohort::timeline::Span> forward_span(std::in_place, "forward");
  const torch::Tensor loss = forward_loss(t.model, x, y, cfg, t.device.type());
  forward_span.reset();
  {
    cohort::timeline::Span span("backward");  // zero2: the buckets' reduce-scatters, overlapped
    t.scaler.scale(loss).backward();
  }
  if (cfg.fp16_autocast && cfg.clip_grad_norm > 0) opt.unscale(t.scaler);
  if (cfg.clip_grad_norm > 0) opt.clip_grad_norm(cfg.clip_grad_norm);  // the global norm, over every rank's shard
  cohort::timeline::Span span("optimizer step");  // zero1's reduce-scatter, the shard step, the allgather
  if (cfg.fp16_autocast)
    opt.step(t.scaler);
  else
    opt.step();
  return loss;
}

// train_step under --shard fsdp: FSDP clears and clips the gradient shards;
// model.forward gathers the root unit first (make_fsdp), each layer is
// gathered as it runs, backward reduce-scatters each layer's gradient into
// this rank's shard; the optimizer steps the shards.
torch::Tensor fsdp_step(Trainer& t, const torch::Tensor& x, const torch::Tensor& y, double lr) {
  const TrainConfig& cfg = t.cfg;
  t.optimizer.optimizer->param_groups()[0].options().set_lr(lr);
  t.fsdp->zero_grad();
  std::optional<cohort::timeline::Span> forward_span(std::in_place, "forward");  // with the units' allgathers
  const torch::Tensor loss = forward_loss(t.model, x, y, cfg, t.device.type());
  forward_span.reset();
  {
    cohort::timeline::Span span("backward");  // the units' allgathers and reduce-scatters, overlapped
    loss.backward();
  }
  if (cfg.clip_grad_norm > 0) t.fsdp->clip_grad_norm(cfg.clip_grad_norm);  // the global norm
  cohort::timeline::Span span("optimizer step");
  t.optimizer.step();
  return loss;
}

}  // namespace

torch::Tensor train_step(Trainer& t, const torch::Tensor& x, const torch::Tensor& y, double lr) {
  if (t.zero) return zero_step(t, x, y, lr);
  if (t.fsdp) return fsdp_step(t, x, y, lr);
  const TrainConfig& cfg = t.cfg;
  torch::optim::Optimizer& opt = *t.optimizer.optimizer;
  opt.param_groups()[0].options().set_lr(lr);
  cohort::torch::zero_grad(opt);  // set to none: backward hands over fresh gradients (no zeroing pass)
  if (t.ddp) t.ddp->pre_forward();
  std::optional<cohort::timeline::Span> forward_span(std::in_place, "forward");
  const torch::Tensor loss = forward_loss(t.model, x, y, cfg, t.device.type());
  forward_span.reset();
  std::optional<cohort::timeline::Span> backward_span(std::in_place, "backward");  // includes DDP's finalize()
  const torch::Tensor scaled = t.scaler.scale(loss);  // the loss itself without --fp16-autocast
  if (cfg.no_allreduce) {
    // --no-allreduce: no gradient communication, the throughput ceiling;
    // --lockstep: the ranks still wait for each other once per step.
    if (t.ddp) {
      auto guard = t.ddp->no_sync();
      scaled.backward();
    } else {
      scaled.backward();
    }
    if (cfg.lockstep) {
      cohort::timeline::Span span("lockstep barrier");
      t.pg.barrier()->wait();
    }
  } else {
    scaled.backward();
  }
  backward_span.reset();
  if (cfg.fp16_autocast && cfg.clip_grad_norm > 0) t.scaler.unscale(opt, &t.pg);  // clip the true gradients
  if (cfg.clip_grad_norm > 0) cohort::torch::clip_grad_norm(t.params, cfg.clip_grad_norm);
  {
    cohort::timeline::Span span("optimizer step");
    if (cfg.fp16_autocast)
      t.scaler.step(opt, &t.pg);  // skipped on every rank when a gradient overflowed
    else
      t.optimizer.step();
  }
  return loss;
}

EpochResult train_epoch(Trainer& t, const cohort::data::FashionMnist& train_set,
                        cohort::data::DistributedSampler& sampler, Progress& at, const LrSchedule& schedule,
                        cohort::StepMetrics& metrics, StepTimes& timed,
                        const std::function<void(const Progress&)>& save) {
  const TrainConfig& cfg = t.cfg;
  const bool lead = t.pg.rank() == 0;
  cohort::data::Loader loader = epoch_loader(cfg, train_set, sampler, at.epoch, at.position);
  const auto epoch_start = Clock::now();
  ProgressLine progress(cfg, t.pg.size(), at.epoch, sampler.size(), at.position, epoch_start);
  double loss_sum = 0;
  int64_t loss_n = 0;
  EpochResult result;
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
    auto x = torch::from_blob(batch->x.data(), {b, 1, 28, 28}).to(t.device);
    auto y = torch::from_blob(batch->y.data(), {b}, torch::kLong).to(t.device);
    const torch::Tensor loss = train_step(t, x, y, schedule.lr(at.step));
    ++at.step;
    at.position += b;
    const double loss_value = loss.item<double>();
    loss_sum += loss_value;
    if (cfg.log_losses && lead) {
      std::printf("LOSS step=%lld value=%.7f\n", static_cast<long long>(at.step), loss_value);
      std::fflush(stdout);  // a line per step as it happens (bench/fault_times.py times them)
    }
    ++loss_n;
    metrics.end_step();
    auto t1 = Clock::now();
    if (at.step > cfg.timing_skip) {
      timed.seconds += secs(t0, t1);
      ++timed.steps;
    }
    if (lead) progress.after_step(at.position, loss_sum, loss_n, t1);
    // At the epoch's last step the save after the epoch (epoch + 1, position 0) follows: one save, not two of one step.
    if (periodic_save_at(cfg, at.step) && at.position < sampler.size()) save(at);
    // --fault-kill-rank / --fault-at-step: the first attempt only, so the restarted job runs through.
    if (t.pg.rank() == cfg.fault_rank && at.step == cfg.fault_step && restart_count() == 0) {
      std::fflush(stdout);
      raise(cfg.fault_signal == "TERM" ? SIGTERM : SIGKILL);  // SIGTERM: t.stop, just below, picks it up
    }
    if (t.stop != nullptr && (result.signal = t.stop->agreed(t.pg)) != 0) {
      result.stopped = true;
      break;
    }
    if (cfg.max_steps > 0 && at.step >= cfg.max_steps) {
      result.stopped = true;
      break;
    }
  }
  result.seconds = secs(epoch_start, Clock::now());
  result.train_loss = cohort::torch::allreduce_scalar(t.pg, loss_n ? loss_sum / loss_n : 0.0) / t.pg.size();
  return result;
}

double evaluate(Model& model, const cohort::data::FashionMnist& test, cohort::ProcessGroup& pg,
                const torch::Device& device) {
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
