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
// job wrote, unless --no-auto-resume. The ranks choose it together
// (choose_checkpoint: each verifies a share of its files); every rank loads it, refuses it when the data order,
// the model or the optimizer would differ (check_resumable), and restores it
// (restore). A checkpoint written at another world size continues the epoch
// after the samples the old world had taken; its sharded optimizer state
// (--shard) is resharded to the new world (restore_sharded_optimizer), or
// gathered into a whole one for a run without --shard, and a whole one is cut
// into shards for a run with it. The same holds for --shard fsdp's sharded
// model: it loads into a run without FSDP (gathered from every rank's part),
// and a whole model into an FSDP run (cut into its shards).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <optional>
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
                "beside them (replacing any of the same step), --keep counts only its own, and a restart resumes "
                "only its own (pass --resume to continue that run instead, or use another directory)\n",
                dir.c_str(), static_cast<long long>(steps.back()));
}

// A run configuration's --shard ("none" for one that predates the flag, or no configuration at all).
std::string shard_of(const nlohmann::json& config) {
  if (!config.is_object()) return "none";
  const auto it = config.find("shard");
  return it != config.end() && it->is_string() ? it->get<std::string>() : "none";
}

struct Chosen {
  std::string path;          // "": none fits
  std::string shard = "none";  // the --shard it was written with
};

// The checkpoint every rank resumes from (a collective: the ranks verify it
// together, each checksumming its share of the files, find_latest_valid),
// rank 0 printing what it skips: with `any_run` (--resume) or no job id, the
// newest valid checkpoint; else the newest one whose configuration names
// `run_id`, so that a restart never resumes an earlier run's checkpoints left
// in the same directory (which may have a higher step). A checkpoint with
// neither a whole model nor FSDP's parts was not written by this program:
// skipped too.
Chosen choose_checkpoint(cohort::ProcessGroup& pg, const std::string& dir, bool any_run, const std::string& run_id) {
  const auto refuse = [&](const cohort::LoadedCheckpoint& c) -> std::string {
    const auto config = nlohmann::json::parse(c.manifest.config, nullptr, false);
    const auto run = config.is_object() ? config.find("run") : config.end();
    if (!c.file_info.contains(shard_of(config) == "fsdp" ? "model.rank0" : "model"))
      return "it holds no model of this program";
    if (any_run || run_id.empty() || (run != config.end() && *run == run_id)) return "";
    return "written by another run";
  };
  // Every rank verifies its share (on nccl over the group's host_group()).
  const auto c = cohort::find_latest_valid(pg, dir, refuse);  // each skipped one also in a WARN line
  if (pg.rank() == 0 && c)
    for (const auto& s : c->skipped) std::printf("resume: skipped %s\n", s.c_str());
  if (!c) return {};
  return Chosen{c->path, shard_of(nlohmann::json::parse(c->manifest.config, nullptr, false))};
}

// What a resume does with state written under --shard `then` in a run with --shard `now` ("": nothing to convert).
std::string conversion_note(const std::string& then, const std::string& now) {
  const bool sharded_then = then != "none", sharded_now = now != "none";
  if (then == now || (then != "fsdp" && now != "fsdp" && sharded_then == sharded_now)) return "";
  if (then == "fsdp")
    return sharded_now ? "its model and optimizer state are gathered from every rank's part, the optimizer state "
                         "then cut into this run's shards"
                       : "its model and optimizer state are gathered from every rank's part";
  if (now == "fsdp")
    return sharded_then ? "its optimizer state is gathered from every rank's part, then cut with the model into this "
                          "run's shards"
                        : "its model and optimizer state are cut into this run's shards";
  return sharded_then ? "its optimizer state is gathered from every rank's part"
                      : "its optimizer state is cut into this run's shards";
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
  // Sharded (zero1, zero2: the same layout; fsdp: the model too) or whole: each loads into the others (restore).
  if (const std::string note = conversion_note(shard_of(saved), shard_of(now)); lead && !note.empty())
    std::printf("resume: the checkpoint was written with --shard %s, this run has --shard %s: %s\n",
                shard_of(saved).c_str(), shard_of(now).c_str(), note.c_str());
  constexpr const char* kSchedule = "this run's learning-rate schedule";
  constexpr const char* kValue = "this run's value";
  if (lead && saved.is_object())
    for (const auto& [key, flag, goes_on_with] :
         {std::tuple{"epochs", "--epochs", kSchedule}, std::tuple{"base_lr", "--lr", kSchedule},
          std::tuple{"warmup_steps", "--warmup-steps", kSchedule}, std::tuple{"momentum", "--momentum", kValue},
          std::tuple{"weight_decay", "--weight-decay", kValue}, std::tuple{"augment", "--augment", kValue},
          std::tuple{"clip_grad_norm", "--clip-grad-norm", kValue}, std::tuple{"comm_hook", "--comm-hook", kValue},
          std::tuple{"bf16_autocast", "--bf16-autocast", kValue},
          std::tuple{"fp16_autocast", "--fp16-autocast", kValue}, std::tuple{"device", "--device", kValue},
          std::tuple{"param_dtype", "--param-dtype", kValue}, std::tuple{"cpu_offload", "--cpu-offload", kValue}})
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

// After each rank tried to load its part: every rank throws when any failed
// (`error`: this rank's message, "" if it succeeded; `what`: the part, for
// the ranks that did not fail), so that none goes on alone.
void all_or_none(cohort::ProcessGroup& pg, const std::string& error, const std::string& what) {
  if (cohort::torch::allreduce_scalar(pg, error.empty() ? 0.0 : 1.0, cohort::ReduceOp::Max) > 0)
    throw cohort::InvalidArgument(error.empty() ? fmt::format("resume: another rank could not load its part of {}", what)
                                                : fmt::format("resume: {}", error));
}

// The files of a checkpoint: those already read, and the others read when
// first asked for.
class CheckpointFiles {
 public:
  explicit CheckpointFiles(const cohort::LoadedCheckpoint& ck) : ck_(ck) {}
  // A whole file ("model", "optimizer"), kept once read.
  const std::vector<cohort::NamedTensor>& operator()(const std::string& name) {
    if (const auto it = ck_.files.find(name); it != ck_.files.end()) return it->second;
    auto& slot = later_[name];
    if (slot.empty()) slot = std::move(cohort::load_checkpoint(ck_.path, {.only_files = {name}}).files.at(name));
    return slot;
  }
  // The saving run's rank `rank`'s part `name` ("<name>.rank<rank>"), not
  // kept: the sharded loaders hold what they need.
  std::vector<cohort::NamedTensor> part(const char* name, int rank) const {
    const auto it = ck_.files.find(fmt::format("{}.rank{}", name, rank));
    return it != ck_.files.end() ? it->second : part_of(ck_.path, name, rank);
  }

 private:
  const cohort::LoadedCheckpoint& ck_;
  std::map<std::string, std::vector<cohort::NamedTensor>> later_;
};

// The model's and the optimizer's state, whichever --shard wrote them
// (`saved`) and whichever this run has: --shard fsdp's parts resharded to
// this world, or gathered into a whole state for a run without FSDP; a whole
// state (or ZeRO's parts, gathered) cut into an FSDP run's shards. Under
// --shard zero1/zero2 the optimizer state waits for the ZeroOptimizer
// (restore_sharded_optimizer). Collective: when any rank fails, every rank
// throws.
void restore_state(const cohort::LoadedCheckpoint& ck, const std::string& saved, const TrainConfig& cfg,
                   cohort::ProcessGroup& pg, Model& model, torch::optim::Optimizer& optimizer,
                   cohort::torch::FullyShardedDataParallel* fsdp) {
  namespace ct = cohort::torch;
  CheckpointFiles file(ck);
  const auto model_part = [&](int rank) { return file.part("model", rank); };
  const auto optim_part = [&](int rank) { return file.part("optimizer", rank); };
  // Written with --shard zero1/zero2 or without --shard: the optimizer's per-parameter state. (An FSDP
  // run with --param-dtype shows bf16 parameters; ZeRO planned its buckets in the fp32 master dtype.)
  const auto with_whole_optimizer = [&](const auto& load) {
    if (saved == "none") return load(file("optimizer"));
    const auto master = fsdp && cfg.param_dtype != "fp32" ? std::optional(torch::kFloat) : std::nullopt;
    load(ct::zero_state_to_full(*model.module, optim_part, master));
  };
  std::string error;
  try {
    if (fsdp && saved == "fsdp") {
      fsdp->load_state_shards(model_part);
      fsdp->load_optimizer_state_shards(optimizer, optim_part);
    } else if (fsdp) {
      fsdp->load_full_state(file("model"));
      with_whole_optimizer([&](const std::vector<cohort::NamedTensor>& o) { fsdp->load_full_optimizer_state(optimizer, o); });
    } else {
      if (saved == "fsdp") ct::load_module_state(*model.module, ct::fsdp_state_to_full(*model.module, model_part));
      else ct::load_module_state(*model.module, file("model"));
      if (cfg.shard == "none" && saved == "fsdp")
        ct::load_optimizer_state(optimizer, ct::fsdp_optimizer_state_to_full(*model.module, optim_part));
      else if (cfg.shard == "none")
        with_whole_optimizer([&](const std::vector<cohort::NamedTensor>& o) { ct::load_optimizer_state(optimizer, o); });
    }
  } catch (const cohort::Error& e) {
    error = e.what();
  }
  all_or_none(pg, error, ck.path);
}

// Loads the checkpoint's state into the model, optimizer and scaler, sets the
// schedule's offset, restores the CPU RNG, and returns where the run continues.
Progress restore(const cohort::LoadedCheckpoint& ck, const TrainConfig& cfg, cohort::ProcessGroup& pg,
                 int64_t per_rank_samples, Model& model, torch::optim::Optimizer& optimizer,
                 cohort::torch::GradScaler& scaler, LrSchedule& schedule,
                 cohort::torch::FullyShardedDataParallel* fsdp) {
  const int world = pg.size();
  const bool lead = pg.rank() == 0;
  const std::string saved = shard_of(nlohmann::json::parse(ck.manifest.config, nullptr, false));
  restore_state(ck, saved, cfg, pg, model, optimizer, fsdp);
  const auto saved_config = nlohmann::json::parse(ck.manifest.config, nullptr, false);
  const auto number = [&](const char* key) {
    const auto it = saved_config.is_object() ? saved_config.find(key) : saved_config.end();
    return it != saved_config.end() && it->is_number() ? it->get<double>() : -1.0;
  };
  Progress at{.step = ck.step, .epoch = ck.manifest.epoch, .position = ck.manifest.sampler_position,
              .resumed_from = ck.path, .saved_shard = saved, .saved_world = ck.manifest.world_size,
              .saved_powersgd = ck.file_info.contains("powersgd.rank0"),
              .same_buckets = number("bucket_cap_mb") == cfg.bucket_cap_mb && number("first_bucket_mb") == cfg.first_bucket_mb};
  if (saved_config.is_object()) {
    const auto add = [&](const nlohmann::json& run) {
      if (run.is_string() && !run.get<std::string>().empty() &&
          std::find(at.lineage.begin(), at.lineage.end(), run.get<std::string>()) == at.lineage.end())
        at.lineage.push_back(run.get<std::string>());
    };
    if (const auto l = saved_config.find("lineage"); l != saved_config.end() && l->is_array())
      for (const auto& run : *l) add(run);
    if (const auto r = saved_config.find("run"); r != saved_config.end()) add(*r);
  }
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
                        {"shard", cfg.shard}, {"param_dtype", cfg.param_dtype}, {"cpu_offload", cfg.cpu_offload},
                        {"bucket_cap_mb", cfg.bucket_cap_mb}, {"first_bucket_mb", cfg.first_bucket_mb}};
}

Progress resume(const TrainConfig& cfg, cohort::ProcessGroup& pg, const nlohmann::json& config,
                int64_t per_rank_samples, Model& model, torch::optim::Optimizer& optimizer,
                cohort::torch::GradScaler& scaler, LrSchedule& schedule,
                cohort::torch::FullyShardedDataParallel* fsdp) {
  const bool lead = pg.rank() == 0;
  const bool resume = wants_resume(cfg, restart_count(), lead);
  if (!resume && !cfg.ckpt_dir.empty() && lead) note_earlier_checkpoints(cfg.ckpt_dir);
  if (!resume || cfg.ckpt_dir.empty()) return {};
  // The ranks choose one checkpoint together and load it (the directory must be visible to every rank).
  // The optimizer's files are not required here: the state may be stored
  // either way (sharded or whole) and loads into either kind of run. With
  // --shard only the model is read now: every rank's optimizer file is
  // checked to exist with its size, and each rank reads the parts it needs
  // later (restore_sharded_optimizer).
  // Every file of the chosen checkpoint is verified, each rank checksumming
  // its share (a damaged optimizer part makes all fall back to an older
  // one); then each rank reads what it needs.
  // --shard fsdp writes no whole model: its checkpoints hold model.rank<r>
  // and optimizer.rank<r> for every rank r (restore_state reads them).
  const Chosen chosen = choose_checkpoint(pg, cfg.ckpt_dir, cfg.resume, config.at("run").get<std::string>());
  if (chosen.path.empty()) {
    // Rank 0 lists the directory and every rank takes its count, so that all
    // stop or all start over together.
    std::string listed;
    if (lead) {
      try {
        listed = std::to_string(cohort::list_checkpoint_steps(cfg.ckpt_dir).size());
      } catch (const std::exception&) {  // not a directory: nothing to resume here, said below
        listed = "0";
      }
    }
    const size_t steps = std::stoul(cohort::torch::broadcast_string(pg, listed, 0));
    // An explicit --resume over checkpoints that all failed their checks
    // stops: starting over beside them would quietly lose the run. (A
    // restart's auto-resume only finds none of its own run: it starts over.)
    if (cfg.resume && steps > 0)
      throw cohort::InvalidArgument(fmt::format(
          "--resume: none of the {} checkpoint(s) in {} can be resumed (each one's reason is above); nothing was "
          "changed. HINT: move the damaged ones aside (they are never deleted or overwritten by a resume), or drop "
          "--resume to start from scratch",
          steps, cfg.ckpt_dir));
    if (lead) {
      const std::string why = !std::filesystem::exists(cfg.ckpt_dir) ? "does not exist yet"
                              : steps == 0                           ? "holds no checkpoints"
                                                                     : "holds no valid checkpoint of this run (see above)";
      std::printf("resume: %s %s: starting from scratch\n", cfg.ckpt_dir.c_str(), why.c_str());
    }
    return {};
  }
  // What this rank reads now: the whole model (with the whole optimizer state for a run without
  // --shard), or FSDP's rank-0 part; the other ranks' parts are read when needed.
  const std::string first = chosen.shard == "fsdp" ? "model.rank0" : "model";
  std::vector<std::string> read_now{first};
  if (cfg.shard == "none" && chosen.shard == "none") read_now.push_back("optimizer");
  const cohort::LoadOptions lopts{.required_files = {first}, .only_files = read_now};
  const auto ck = cohort::load_checkpoint(chosen.path, lopts);
  check_resumable(ck, config, lead);
  return restore(ck, cfg, pg, per_rank_samples, model, optimizer, scaler, schedule, fsdp);
}

void restore_powersgd(cohort::ddp::PowerSgdState& state, cohort::ProcessGroup& pg, const Progress& at) {
  // Every rank decides from the same manifest: all load, or none.
  const bool lead = pg.rank() == 0;
  if (!at.saved_powersgd || !at.same_buckets) {
    if (lead)
      std::printf("resume: %s %s: the PowerSGD hook starts afresh\n", at.resumed_from.c_str(),
                  !at.saved_powersgd ? "holds no PowerSGD state (written without --comm-hook powersgd)"
                                     : "was written with other --bucket-cap-mb/--first-bucket-mb (other buckets)");
    return;
  }
  // The error feedback is each rank's own: at another world size only rank 0's iteration and Qs.
  const bool same_world = at.saved_world == pg.size();
  const std::string mine = fmt::format("powersgd.rank{}", same_world ? pg.rank() : 0);
  std::string error;
  try {
    const auto ck = cohort::load_checkpoint(at.resumed_from, {.only_files = {mine}});
    state.load_state(ck.files.at(mine), /*with_error=*/same_world);
  } catch (const cohort::Error& e) {
    error = e.what();
  }
  all_or_none(pg, error, "the PowerSGD state of " + at.resumed_from);
  if (lead && !same_world)
    std::printf("resume: the PowerSGD error feedback is each rank's own and this run has another world size: it "
                "restarts at zero\n");
}

void restore_sharded_optimizer(cohort::torch::ZeroOptimizer& zero, const Model& model, cohort::ProcessGroup& pg,
                               const Progress& at) {
  std::string error;
  try {
    const auto optim_part = [&](int rank) { return part_of(at.resumed_from, "optimizer", rank); };
    if (at.saved_shard == "fsdp") {
      zero.load_full_state(cohort::torch::fsdp_optimizer_state_to_full(*model.module, optim_part));
    } else if (at.saved_shard != "none" && at.same_buckets) {
      zero.load_state_shards(optim_part);  // any world size, the same bucket layout
    } else if (at.saved_shard != "none") {
      // Another bucket layout (--bucket-cap-mb / --first-bucket-mb changed):
      // gathered by the layout the shards recorded, then cut by this run's.
      if (pg.rank() == 0)
        std::printf("resume: the checkpoint's ZeRO buckets are not this run's (another --bucket-cap-mb or "
                    "--first-bucket-mb): gathering its optimizer state and cutting it into this run's buckets\n");
      zero.load_full_state(cohort::torch::zero_state_to_full(*model.module, optim_part));
    } else {
      auto ck = cohort::load_checkpoint(at.resumed_from, {.only_files = {"optimizer"}});
      zero.load_full_state(ck.files.at("optimizer"));
    }
  } catch (const cohort::Error& e) {
    error = e.what();
  }
  // Every rank reads other files: all go on, or all stop, together.
  all_or_none(pg, error, "the optimizer state of " + at.resumed_from);
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

// --keep N counts and deletes this run's checkpoints only, and those of the
// runs it continues (--resume, a restart: the config's "lineage"): another
// run's in the same directory neither takes this run's places nor is deleted
// by it.
cohort::SaveOptions retention(const TrainConfig& cfg, const nlohmann::json& config) {
  cohort::SaveOptions o{.keep_last = cfg.keep};
  const std::string run = config.value("run", "");
  // No job id (run outside a launcher), or torchrun's shared default "none":
  // every checkpoint counts, as before.
  if (run.empty() || run == "none") return o;
  std::vector<std::string> ours{run};
  if (const auto l = config.find("lineage"); l != config.end() && l->is_array())
    for (const auto& r : *l)
      if (r.is_string()) ours.push_back(r.get<std::string>());
  o.keep_last_among = [ours](const cohort::Manifest& m) {
    const auto c = nlohmann::json::parse(m.config, nullptr, false);
    const auto r = c.is_object() ? c.find("run") : c.end();
    return r != c.end() && r->is_string() && std::find(ours.begin(), ours.end(), r->get<std::string>()) != ours.end();
  };
  return o;
}

}  // namespace

void write_checkpoint(cohort::ProcessGroup& pg, const TrainConfig& cfg, const Progress& at, const Model& model,
                      torch::optim::Optimizer& optimizer, cohort::torch::ZeroOptimizer* zero,
                      cohort::torch::FullyShardedDataParallel* fsdp, const cohort::torch::GradScaler& scaler,
                      const LrSchedule& schedule, const nlohmann::json& config,
                      const cohort::ddp::PowerSgdState* powersgd) {
  if (cfg.ckpt_dir.empty()) return;
  // Every rank's last step is complete and its gradient collectives did not
  // fail before rank 0 writes (with DDP's stream-ordered wait a failure
  // would otherwise show only at the next collective).
  pg.barrier()->wait();
  const bool lead = pg.rank() == 0;
  const auto started = Clock::now();
  std::string path;
  if (zero || fsdp || powersgd) {
    std::map<std::string, std::vector<cohort::NamedTensor>> files;
    if (fsdp) {  // no rank holds the whole model: each writes its shard of it
      files[fmt::format("model.rank{}", pg.rank())] = fsdp->state_shard();
      files[fmt::format("optimizer.rank{}", pg.rank())] = fsdp->optimizer_state_shard(optimizer);
    } else if (zero) {
      files[fmt::format("optimizer.rank{}", pg.rank())] = zero->state_shard();
      if (lead) files["model"] = cohort::torch::module_state(*model.module);
    } else if (lead) {
      files["model"] = cohort::torch::module_state(*model.module);
      files["optimizer"] = cohort::torch::optimizer_state(optimizer);
    }
    if (powersgd) files[fmt::format("powersgd.rank{}", pg.rank())] = powersgd->state();
    path = cohort::save_checkpoint_sharded(pg, cfg.ckpt_dir, at.step, files,
                                           lead ? manifest_of(pg, cfg, at, scaler, schedule, config) : cohort::Manifest{},
                                           retention(cfg, config));
  } else if (lead) {
    path = cohort::save_checkpoint(
        cfg.ckpt_dir, at.step,
        {{"model", cohort::torch::module_state(*model.module)}, {"optimizer", cohort::torch::optimizer_state(optimizer)}},
        manifest_of(pg, cfg, at, scaler, schedule, config), retention(cfg, config));
  }
  if (lead) {
    std::printf("checkpoint: step %lld saved to %s (%.0f ms)\n", static_cast<long long>(at.step), path.c_str(),
                std::chrono::duration<double>(Clock::now() - started).count() * 1000);
    std::fflush(stdout);
  }
  pg.barrier()->wait();
}
