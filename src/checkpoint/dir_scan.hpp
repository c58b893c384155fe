// Reading a checkpoint directory's structure: shared by save (retention,
// leftovers) and load (finding and verifying checkpoints).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/manifest.hpp"
#include "cohort/filesystem.hpp"

namespace cohort::ckpt {

std::string join_path(const std::string& dir, std::string_view name);

struct StepDir {
  int64_t step = 0;
  std::string name;          // "step_000001234", or its moved-aside name
  bool moved_aside = false;  // "step_000001234.tmp-<pid>-old" (see below)
};

// The step_* subdirectories of `dir` by ascending step: canonical names only
// (step_dir_name), no symbolic links, no *.tmp-*, except that a step whose only
// copy is a moved-aside one (a re-save of that step crashed between its two
// renames, save.cpp) is listed under that name. A missing `dir` gives an empty list.
std::vector<StepDir> list_step_dirs(Filesystem& fs, const std::string& dir);

// The subdirectories of `dir` with temporary names (*.tmp-*).
std::vector<std::string> list_temp_dirs(Filesystem& fs, const std::string& dir);

// Reads and parses step_dir/manifest.json (at most 64 MiB). Throws FormatError
// if it is missing, too large or invalid; IoError if it cannot be read.
ParsedManifest read_manifest(Filesystem& fs, const std::string& step_dir);

// A cheap validity test (no checksums) of a manifest already read: every file
// it lists exists in step_dir with the size it gives. Retention counts only
// checkpoints whose manifest parses and passes it.
bool files_as_listed(Filesystem& fs, const std::string& step_dir, const ParsedManifest& pm) noexcept;

}  // namespace cohort::ckpt
