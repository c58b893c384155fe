// Names and retention in a checkpoint directory (pure functions; see
// docs/checkpoint-format.md):
//   ckpt_dir/step_000001234/                 a complete checkpoint
//   ckpt_dir/step_000001234.tmp-<pid>[-tag]/ a save in progress, a crashed save,
//                                            or an old checkpoint being deleted
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace cohort::ckpt {

inline constexpr int kFormatVersion = 2;  // 2: manifest_crc32c (1 is still read)
inline constexpr std::string_view kManifestName = "manifest.json";
inline constexpr std::string_view kTensorFileSuffix = ".safetensors";

// "step_000001234": nine digits, more for steps past 999,999,999.
std::string step_dir_name(int64_t step);
// The step of a "step_<digits>" name; nullopt for anything else (temporary names included).
std::optional<int64_t> parse_step_dir_name(std::string_view name);
// The step of a checkpoint that a save of the same step moved aside
// ("step_<digits>.tmp-<pid>-old", save.cpp step 5); nullopt for other names.
std::optional<int64_t> parse_moved_aside_name(std::string_view name);
// True for the temporary names the loader ignores and the next save removes.
bool is_temp_name(std::string_view name);
std::string temp_dir_name(int64_t step, long pid, std::string_view tag = {});

// Throws InvalidArgument unless `name` (a file name without ".safetensors") is
// 1-200 characters of [A-Za-z0-9_.-], not starting with '.', and not "manifest".
void check_file_name(std::string_view name);

// Retention after saving `saved`: of `existing` (every step directory, valid or
// not, with whether its manifest parses), keep the newest `keep_last` valid ones
// at or below `saved`, and return the steps older than the oldest kept one.
// Steps above `saved` are never returned. keep_last <= 0 returns nothing.
struct StepState {
  int64_t step = 0;
  bool valid = false;
  bool ours = true;  // counted and deleted by retention (SaveOptions::keep_last_among)
};
std::vector<int64_t> steps_to_delete(std::vector<StepState> existing, int64_t saved, int keep_last);

}  // namespace cohort::ckpt
