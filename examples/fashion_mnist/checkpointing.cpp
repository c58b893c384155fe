// Checkpoints: what a save writes, and how a run resumes from one.
//
// write_checkpoint: after a barrier (every rank's last step complete), rank 0
// saves a checkpoint directory (cohort::save_checkpoint, atomic) with the
// model and optimizer state and a manifest holding the Progress (epoch,
// sampler position, step), the world size, the CPU RNG state, the learning-
// rate schedule (with the GradScaler's scale under --fp16-autocast) and
// run_config(); a second barrier holds the others until it is written. Under
// --shard each rank holds only its part of the optimizer state: every rank
// writes "optimizer.rank<r>" into the same checkpoint
// (cohort::save_checkpoint_sharded, atomic for the whole), rank 0 the model.
//
// resume: --resume takes the newest valid checkpoint in --checkpoint-dir; a
// restart by the launcher (TORCHELASTIC_RESTART_COUNT > 0) the newest one this
// job wrote, unless --no-auto-resume. Rank 0 chooses (choose_checkpoint) and
// broadcasts the path; every rank loads it, refuses it when the data order,
// the model or the optimizer would differ (check_resumable), and restores it
// (restore). A checkpoint written at another world size continues the epoch
// after the samples the old world had taken; its sharded optimizer state
// (--shard) is resharded to the new world (restore_sharded_optimizer), or
// gathered into a whole one for a run without --shard, and a whole one is cut
// into shards for a run with it.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <tuple>

#include "parts.hpp"

namespace {

using Clock = std::chrono::steady_clock;

// --resume, or a restart by the launcher unless --no-auto-resume: the work
// since the newest checkpoint is all a failure costs. Rank 0 prints why an
// auto-resume happens.
bool wants_resume(const TrainConfig& cfg, int restarts, bool lead) {
  const bool resume = cfg.resume || (cfg.auto_resume && restarts > 0);
  if (resume && !cfg.resume && lead) {
    if (cfg.ckpt_dir.empty())
      std::printf("auto-resume: restart %d, but no --checkpoint-dir: starting from scratch\n", restarts);
    else
      std::printf(
          "auto-resume: restart %d (TORCHELASTIC_RESTART_COUNT), resuming from the newest valid checkpoint in "
          "%s (--no-auto-resume starts over)\n",
          restarts, cfg.ckpt_dir.c_str());
  }
  return resume;
}

// A fresh run saving beside an earlier run's checkpoints: say that a restart
// will not resume those (rank 0).
void note_earlier_checkpoints(const std::string& dir) {
  const auto steps = cohort::list_checkpoint_steps(dir);
  if (!steps.empty())
    std::printf("note: --checkpoint-dir %s holds checkpoints of an earlier run (newest: step %lld); this run saves "
                "beside them and a restart resumes only its own (pass --resume to continue that run instead)\n",
                dir.c_str(), static_cast<long long>(steps.back()));
}

// Rank 0's choice, "" when none fits: with `any_run` (--resume) or no job id,
// the newest valid checkpoint; else the newest one whose configuration names
// `run_id`, so that a restart never resumes an earlier run's checkpoints left
// in the same directory (which may have a higher step). Prints what it skips.
std::string choose_checkpoint(const std::string& dir, const cohort::LoadOptions& lopts, bool any_run,
                              const std::string& run_id) {
  auto latest = cohort::load_latest_valid(dir, lopts);
  if (!latest) return "";
  for (const auto& s : latest->skipped) std::printf("resume: skipped %s\n", s.c_str());
  if (any_run || run_id.empty()) return latest->path;
  const auto steps = cohort::list_checkpoint_steps(dir);
  for (auto at = steps.rbegin(); at != steps.rend(); ++at) {
    if (*at > latest->step) continue;
    try {
      auto c = *at == latest->step ? std::move(*latest)
                                   : cohort::load_checkpoint(fmt::format("{}/step_{:09d}", dir, *at), lopts);
      if (nlohmann::json::parse(c.manifest.config).value("run", std::string()) == run_id) return c.path;
      std::printf("resume: skipped %s: written by another run\n", c.path.c_str());
    } catch (const cohort::IoError& e) {
      std::printf("resume: skipped step %lld: %s\n", static_cast<long long>(*at), e.what());
    }
  }
  return "";
}

// A run configuration's --shard ("none" for one that predates the flag, or no configuration at all).
std::string shard_of(const nlohmann::json& config) {
  return config.is_object() ? config.value("shard", "none") : "none";
}

// What fixes the data order and the step count, and what the saved state
// belongs to, must be the same as when the checkpoint was written, or the
// run would not continue where it stopped: throws InvalidArgument naming the
// flag. The rest may change between runs (a lower learning rate after a
// divergence, ...): the run goes on with this run's value, and rank 0 says so.
void check_resumable(const cohort::LoadedCheckpoint& ck, const nlohmann::json& now, bool lead) {
  const auto saved = nlohmann::json::parse(ck.manifest.config, nullptr, false);
  const auto show = [](const nlohmann::json& j) { return j.is_string() ? j.get<std::string>() : j.dump(); };
  // `what` shows a value ("--seed {}"); `flag` is the option that sets it.
  const auto differs = [&](const char* key, const char* what, const char* flag, const char* why) {
    if (!saved.is_object() || !saved.contains(key) || saved[key] == now.at(key)) return;
    const std::string then = fmt::format(fmt::runtime(what), show(saved[key]));
    throw cohort::InvalidArgument(fmt::format(
        "cannot resume from {}: it was written with {}, this run has {}, so {}; HINT: resume with the same {} ({}), "
        "or start a new run with another --checkpoint-dir",
        ck.path, then, fmt::format(fmt::runtime(what), show(now.at(key))), why, flag, then));
  };
  constexpr const char* kOrder = "the data order and the step count would not continue where that run stopped";
  differs("batch_size", "--batch-size {}", "--batch-size", kOrder);
  differs("seed", "--seed {}", "--seed", kOrder);
  differs("train_samples", "{} training samples", "--train-limit", kOrder);
  differs("model", "--model {}", "--model", "its weights do not fit this model");
  differs("optimizer", "--optimizer {}", "--optimizer", "its optimizer state is another optimizer's");
  // FSDP's checkpoints hold the model in shards: they resume under --shard fsdp
  // only (at any world size), and it resumes only them.
  if ((shard_of(saved) == "fsdp") != (shard_of(now) == "fsdp"))
    throw cohort::InvalidArgument(fmt::format(
        "cannot resume from {}: it was written with --shard {}, this run has --shard {}; a --shard fsdp checkpoint "
        "holds the model in per-rank shards that only --shard fsdp reads (at any world size). HINT: resume with "
        "--shard {}, or start a new run with another --checkpoint-dir",
        ck.path, shard_of(saved), shard_of(now), shard_of(saved)));
  // Sharded (zero1, zero2: the same layout) or whole: either loads into the other (restore).
  if (lead && (shard_of(saved) != "none") != (shard_of(now) != "none"))
    std::printf("resume: the checkpoint was written with --shard %s, this run has --shard %s: its optimizer state is %s\n",
                shard_of(saved).c_str(), shard_of(now).c_str(),
                shard_of(saved) != "none" ? "gathered from every rank's part" : "cut into this run's shards");
  constexpr const char* kSchedule = "this run's learning-rate schedule";
  constexpr const char* kValue = "this run's value";
  if (lead && saved.is_object())
    for (const auto& [key, flag, goes_on_with] :
         {std::tuple{"epochs", "--epochs", kSchedule}, std::tuple{"base_lr", "--lr", kSchedule},
          std::tuple{"warmup_steps", "--warmup-steps", kSchedule}, std::tuple{"momentum", "--momentum", kValue},
          std::tuple{"weight_decay", "--weight-decay", kValue}, std::tuple{"augment", "--augment", kValue},
          std::tuple{"clip_grad_norm", "--clip-grad-norm", kValue}, std::tuple{"comm_hook", "--comm-hook", kValue},
          std::tuple{"bf16_autocast", "--bf16-autocast", kValue},
          std::tuple{"fp16_autocast", "--fp16-autocast", kValue}, std::tuple{"device", "--device", kValue}})
      if (saved.contains(key) && saved[key] != now.at(key))
        std::printf("resume: the checkpoint was written with %s %s, this run has %s: the run continues with %s\n", flag,
                    show(saved[key]).c_str(), show(now.at(key)).c_str(), goes_on_with);
}

// Part `name` of rank `rank` of a sharded checkpoint (that file alone is read).
std::vector<cohort::NamedTensor> part_of(const std::string& path, const char* name, int rank) {
  const std::string file = fmt::format("{}.rank{}", name, rank);
  auto ck = cohort::load_checkpoint(path, {.only_files = {file}});
  return std::move(ck.files.at(file));
}

// --shard fsdp: the model's and the optimizer's shards, resharded from the
// world that wrote them to this one; each rank reads only the files that
// hold its part. Collective: when any rank fails, every rank throws.
void restore_fsdp(cohort::torch::FullyShardedDataParallel& fsdp, torch::optim::Optimizer& optimizer,
                  cohort::ProcessGroup& pg, const std::string& path) {
  std::string error;
  try {
    fsdp.load_state_shards([&](int rank) { return part_of(path, "model", rank); });
    fsdp.load_optimizer_state_shards(optimizer, [&](int rank) { return part_of(path, "optimizer", rank); });
  } catch (const cohort::Error& e) {
    error = e.what();
  }
  if (cohort::torch::allreduce_scalar(pg, error.empty() ? 0.0 : 1.0, cohort::ReduceOp::Max) > 0)
    throw cohort::InvalidArgument(error.empty() ? fmt::format("resume: another rank could not load its part of {}", path)
                                                : fmt::format("resume: {}", error));
}

// Loads the checkpoint's state into the model, optimizer and scaler, sets the
// schedule's offset, restores the CPU RNG, and returns where the run continues.
Progress restore(const cohort::LoadedCheckpoint& ck, const TrainConfig& cfg, cohort::ProcessGroup& pg,
                 int64_t per_rank_samples, Model& model, torch::optim::Optimizer& optimizer,
                 cohort::torch::GradScaler& scaler, LrSchedule& schedule,
                 cohort::torch::FullyShardedDataParallel* fsdp) {
  const int world = pg.size();
  const bool lead = pg.rank() == 0;
  if (fsdp) restore_fsdp(*fsdp, optimizer, pg, ck.path);
  else cohort::torch::load_module_state(*model.module, ck.files.at("model"));
  // Sharded optimizer state (--shard) is loaded once the ZeroOptimizer exists (restore_sharded_optimizer).
  const bool sharded = shard_of(nlohmann::json::parse(ck.manifest.config, nullptr, false)) != "none";
  if (fsdp) {
    // loaded above
  } else if (cfg.shard == "none" && sharded) {
    // Written with --shard: every rank's part, gathered into this optimizer's per-parameter state.
    cohort::torch::load_optimizer_state(
        optimizer, cohort::torch::zero_state_to_full(*model.module, [&](int rank) {
          return ck.files.at(fmt::format("optimizer.rank{}", rank));  // a run without --shard reads every file
        }));
  } else if (cfg.shard == "none") {
    const auto it = ck.files.find("optimizer");
    if (it == ck.files.end())
      throw cohort::FormatError(fmt::format("checkpoint '{}' has no optimizer.safetensors: it was not written by this "
                                            "program; start a new run with another --checkpoint-dir",
                                            ck.path));
    cohort::torch::load_optimizer_state(optimizer, it->second);
  }
  Progress at{.step = ck.step, .epoch = ck.manifest.epoch, .position = ck.manifest.sampler_position,
              .resumed_from = ck.path, .sharded_state = sharded};
  // The schedule's own step (it differs from `step` after an earlier change of world size).
  if (auto sched = nlohmann::json::parse(ck.manifest.lr_schedule, nullptr, false); sched.is_object()) {
    schedule.offset = sched.value("step", at.step) - at.step;
    if (cfg.fp16_autocast && sched.contains("grad_scale"))
      scaler.load(sched.value("grad_scale", scaler.current_scale()), sched.value("growth_tracker", 0));
  }
  if (ck.manifest.world_size != world) {
    // Every rank of the old world took sampler_position samples of the
    // epoch's permutation, together its first sampler_position x old world
    // entries; here each rank skips its share of those (a few may repeat).
    // The LR schedule continues from the same point of the run.
    const int64_t seen = at.position * ck.manifest.world_size;
    at.position = std::min<int64_t>(seen / world, per_rank_samples);
    schedule.offset =
        at.epoch * batches(per_rank_samples, cfg.batch_size) + batches(at.position, cfg.batch_size) - at.step;
    if (lead)
      std::printf("resume: the checkpoint was written by %d ranks, this run has %d: the epoch continues after its "
                  "first %lld samples, the learning-rate schedule at its step %lld of %lld\n",
                  ck.manifest.world_size, world, static_cast<long long>(seen),
                  static_cast<long long>(at.step + schedule.offset), static_cast<long long>(schedule.total));
  }
  if (auto it = ck.manifest.rng_states.find("torch_cpu"); it != ck.manifest.rng_states.end())
    cohort::torch::set_cpu_rng_state(it->second);
  if (lead)
    std::printf("resumed from %s: epoch %lld, step %lld, sample %lld of the epoch\n", ck.path.c_str(),
                static_cast<long long>(at.epoch), static_cast<long long>(at.step), static_cast<long long>(at.position));
  return at;
}

}  // namespace

int restart_count() {
  const char* restart_env = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return restart_env != nullptr ? std::atoi(restart_env) : 0;
}

std::string job_run_id() {
  const char* run_env = std::getenv("COHORT_RUN_ID") ? std::getenv("COHORT_RUN_ID") : std::getenv("TORCHELASTIC_RUN_ID");
  return run_env != nullptr ? run_env : "";
}

nlohmann::json run_config(const TrainConfig& cfg, const torch::Device& device, int64_t train_samples, int world,
                          const std::string& run_id) {
  return nlohmann::json{{"model", cfg.model}, {"epochs", cfg.epochs}, {"batch_size", cfg.batch_size}, {"base_lr", cfg.base_lr},
                        {"optimizer", cfg.optimizer}, {"momentum", cfg.momentum}, {"weight_decay", cfg.weight_decay},
                        {"warmup_steps", cfg.warmup_steps}, {"augment", cfg.augment}, {"clip_grad_norm", cfg.clip_grad_norm},
                        {"comm_hook", cfg.comm_hook}, {"bf16_autocast", cfg.bf16_autocast},
                        {"fp16_autocast", cfg.fp16_autocast}, {"device", device.str()}, {"seed", cfg.seed},
                        {"train_samples", train_samples}, {"world_size", world}, {"run", run_id},
                        {"shard", cfg.shard}};
}

Progress resume(const TrainConfig& cfg, cohort::ProcessGroup& pg, const nlohmann::json& config,
                int64_t per_rank_samples, Model& model, torch::optim::Optimizer& optimizer,
                cohort::torch::GradScaler& scaler, LrSchedule& schedule,
                cohort::torch::FullyShardedDataParallel* fsdp) {
  const bool lead = pg.rank() == 0;
  const bool resume = wants_resume(cfg, restart_count(), lead);
  if (!resume && !cfg.ckpt_dir.empty() && lead) note_earlier_checkpoints(cfg.ckpt_dir);
  if (!resume || cfg.ckpt_dir.empty()) return {};
  // Rank 0 picks the checkpoint; everyone loads that one (the directory must be visible to every rank).
  // The optimizer's files are not required here: the state may be stored
  // either way (sharded or whole) and loads into either kind of run. With
  // --shard only the model is read now: every rank's optimizer file is
  // checked to exist with its size, and each rank reads the parts it needs
  // later (restore_sharded_optimizer).
  // Rank 0 verifies every file of the checkpoint it chooses (a damaged
  // optimizer part makes it fall back to an older one); the others then
  // read what they need.
  // --shard fsdp writes no whole model: its checkpoints hold model.rank<r>
  // and optimizer.rank<r> for every rank r (restore_fsdp reads them).
  const bool fsdp_run = cfg.shard == "fsdp";
  const cohort::LoadOptions choose{.required_files = {fsdp_run ? "model.rank0" : "model"}};
  const cohort::LoadOptions lopts =
      cfg.shard == "none" ? choose
                          : cohort::LoadOptions{.required_files = choose.required_files, .only_files = choose.required_files};
  std::string chosen;
  if (lead) chosen = choose_checkpoint(cfg.ckpt_dir, choose, cfg.resume, config.at("run").get<std::string>());
  chosen = cohort::torch::broadcast_string(pg, chosen, 0);
  if (chosen.empty()) {
    if (lead)
      std::printf("resume: no valid checkpoint in %s%s, starting from scratch\n", cfg.ckpt_dir.c_str(),
                  fsdp_run ? " written with --shard fsdp" : "");
    return {};
  }
  const auto ck = cohort::load_checkpoint(chosen, lopts);
  check_resumable(ck, config, lead);
  return restore(ck, cfg, pg, per_rank_samples, model, optimizer, scaler, schedule, fsdp);
}

void restore_sharded_optimizer(cohort::torch::ZeroOptimizer& zero, cohort::ProcessGroup& pg, const Progress& at) {
  std::string error;
  try {
    if (at.sharded_state) {
      zero.load_state_shards([&](int rank) { return part_of(at.resumed_from, "optimizer", rank); });
    } else {
      auto ck = cohort::load_checkpoint(at.resumed_from, {.only_files = {"optimizer"}});
      zero.load_full_state(ck.files.at("optimizer"));
    }
  } catch (const cohort::Error& e) {
    error = e.what();
  }
  // Every rank reads other files: all go on, or all stop, together.
  if (cohort::torch::allreduce_scalar(pg, error.empty() ? 0.0 : 1.0, cohort::ReduceOp::Max) > 0)
    throw cohort::InvalidArgument(error.empty() ? fmt::format("resume: another rank could not load its part of the "
                                                              "optimizer state of {}", at.resumed_from)
                                                : fmt::format("resume: {}", error));
}

namespace {

// The manifest of a checkpoint of `at` (rank 0's).
cohort::Manifest manifest_of(cohort::ProcessGroup& pg, const TrainConfig& cfg, const Progress& at,
                             const cohort::torch::GradScaler& scaler, const LrSchedule& schedule,
                             const nlohmann::json& config) {
  cohort::Manifest m;
  m.epoch = at.epoch;
  m.sampler_position = at.position;
  m.world_size = pg.size();
  m.rng_states["torch_cpu"] = cohort::torch::cpu_rng_state();
  nlohmann::json lr{{"step", at.step + schedule.offset}, {"peak", schedule.peak}, {"warmup", schedule.warmup}, {"total", schedule.total}};
  // The scaler's state, for an exact resume.
  if (cfg.fp16_autocast) {
    lr["grad_scale"] = scaler.current_scale();
    lr["growth_tracker"] = scaler.growth_tracker();
  }
  m.lr_schedule = lr.dump();
  m.config = config.dump();
  return m;
}

}  // namespace

void write_checkpoint(cohort::ProcessGroup& pg, const TrainConfig& cfg, const Progress& at, const Model& model,
                      torch::optim::Optimizer& optimizer, cohort::torch::ZeroOptimizer* zero,
                      cohort::torch::FullyShardedDataParallel* fsdp, const cohort::torch::GradScaler& scaler,
                      const LrSchedule& schedule, const nlohmann::json& config) {
  if (cfg.ckpt_dir.empty()) return;
  // Every rank's last step is complete and its gradient collectives did not
  // fail before rank 0 writes (with DDP's stream-ordered wait a failure
  // would otherwise show only at the next collective).
  pg.barrier()->wait();
  const bool lead = pg.rank() == 0;
  const auto started = Clock::now();
  std::string path;
  if (zero || fsdp) {
    std::map<std::string, std::vector<cohort::NamedTensor>> files;
    if (fsdp) {  // no rank holds the whole model: each writes its shard of it
      files[fmt::format("model.rank{}", pg.rank())] = fsdp->state_shard();
      files[fmt::format("optimizer.rank{}", pg.rank())] = fsdp->optimizer_state_shard(optimizer);
    } else {
      files[fmt::format("optimizer.rank{}", pg.rank())] = zero->state_shard();
      if (lead) files["model"] = cohort::torch::module_state(*model.module);
    }
    path = cohort::save_checkpoint_sharded(pg, cfg.ckpt_dir, at.step, files,
                                           lead ? manifest_of(pg, cfg, at, scaler, schedule, config) : cohort::Manifest{},
                                           {.keep_last = cfg.keep});
  } else if (lead) {
    path = cohort::save_checkpoint(
        cfg.ckpt_dir, at.step,
        {{"model", cohort::torch::module_state(*model.module)}, {"optimizer", cohort::torch::optimizer_state(optimizer)}},
        manifest_of(pg, cfg, at, scaler, schedule, config), {.keep_last = cfg.keep});
  }
  if (lead) {
    std::printf("checkpoint: step %lld saved to %s (%.0f ms)\n", static_cast<long long>(at.step), path.c_str(),
                std::chrono::duration<double>(Clock::now() - started).count() * 1000);
    std::fflush(stdout);
  }
  pg.barrier()->wait();
}
