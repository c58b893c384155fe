// save_checkpoint: the atomic write of one checkpoint directory.
//
// Steps, and why each is in that order (a crash may stop the process between
// any two of them; "visible" means under a step_<digits> name the loader reads):
//   1. Check every argument and lay out every safetensors header. Bad input
//      throws here, before the disk is touched.
//   2. Create ckpt_dir (and its missing parents, each fsync'ed into its own
//      parent), take its writer lock (Filesystem::lock_dir: flock on
//      .cohort-save.lock, held until the save returns; another process
//      saving there at the same moment gets an IoError naming the holder),
//      then remove *.tmp-* directories left by crashed saves (a
//      failure to remove one is logged, not thrown), except a step moved aside
//      by step 5 and never replaced: that one is renamed back.
//   3. mkdir step_X.tmp-<pid>/ and write each <name>.safetensors into it, each
//      fsync'ed and closed. Nothing is visible yet.
//   4. Write manifest.json last (fsync, close): it holds each file's size and
//      CRC32C and "complete": true. Then fsync the temporary directory, so its
//      entries are durable before it gets its real name.
//   5. rename step_X.tmp-<pid> -> step_X (atomic), then fsync ckpt_dir so the
//      rename itself survives a power loss. This is the commit point. If step_X
//      already existed it is first renamed to step_X.tmp-<pid>-old and removed
//      after the commit. A crash between those two renames leaves the old
//      step X only under that name: the loader still finds it there, and the
//      next save renames it back (step 2) instead of deleting it.
//   6. Retention (keep_last): counting only checkpoints whose manifest parses
//      and whose files exist with the sizes it lists (and, with
//      keep_last_among, whose manifest it accepts: only those are deleted
//      then), rename each expired
//      step_Y to a temporary name,
//      fsync ckpt_dir, then remove it. A checkpoint is never half-deleted
//      under its visible name. Failures here are logged, not thrown: the new
//      checkpoint is already safe.
// On an error in 3-5 the temporary directory is removed (best effort) and the
// error rethrown; the previous checkpoints are untouched in every case.
#include <unistd.h>

#include <algorithm>
#include <optional>

#include <fmt/format.h>

#include "checkpoint/dir_scan.hpp"
#include "checkpoint/layout.hpp"
#include "checkpoint/manifest.hpp"
#include "checkpoint/safetensors.hpp"
#include "checkpoint/save_steps.hpp"
#include "cohort/checkpoint.hpp"
#include "core/log.hpp"

namespace cohort {
namespace {

using namespace ckpt;

std::string parent_of(const std::string& path) {
  auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// mkdir -p through the seam; each directory we create is fsync'ed into its parent.
void make_dirs(Filesystem& fs, const std::string& dir) {
  if (dir.empty() || fs.is_dir(dir)) return;
  make_dirs(fs, parent_of(dir));
  try {
    fs.create_dir(dir);
  } catch (const IoError&) {
    if (!fs.is_dir(dir)) throw;  // another process may have created it meanwhile
    return;
  }
  fs.sync_dir(parent_of(dir));
}

void remove_quietly(Filesystem& fs, const std::string& path) noexcept {
  try {
    remove_all(fs, path);
  } catch (const std::exception& e) {
    COHORT_WARN(kInit, "checkpoint: could not remove '{}': {}", path, e.what());
  } catch (...) {
  }
}

void write_file(Filesystem& fs, const std::string& path, const std::string& bytes) {
  auto f = fs.create_file(path);
  f->append(bytes.data(), bytes.size());
  f->sync();
  f->close();
}

// Step 2: a committed step X that a crashed re-save of X moved aside and never
// replaced goes back under its name (true), rather than being deleted as a
// leftover. True also when it cannot be moved back: then it stays for the
// loader (which reads it under that name) and the next save.
bool restore_moved_aside(Filesystem& fs, const std::string& dir, const std::string& name) noexcept {
  try {
    const std::optional<int64_t> step = parse_moved_aside_name(name);
    if (!step) return false;
    const std::string canonical = join_path(dir, step_dir_name(*step));
    if (fs.exists(canonical) || fs.is_symlink(canonical)) return false;  // step X was saved again: a leftover
    try {
      fs.rename(join_path(dir, name), canonical);
      fs.sync_dir(dir);
      COHORT_INFO(kInit, "checkpoint: restored '{}' from '{}', moved aside by a save that did not finish", canonical,
                  name);
    } catch (const std::exception& e) {
      COHORT_WARN(kInit, "checkpoint: could not restore '{}' from '{}': {}", canonical, name, e.what());
    }
    return true;
  } catch (...) {
    return true;  // when in doubt, keep it
  }
}

// Step 6. Never throws: the new checkpoint is committed already.
void apply_retention(Filesystem& fs, const std::string& dir, int64_t saved, const SaveOptions& options) {
  const int keep_last = options.keep_last;
  if (keep_last <= 0) return;
  try {
    std::vector<StepDir> dirs = list_step_dirs(fs, dir);
    std::vector<StepState> states;
    for (const StepDir& d : dirs) {
      const std::string path = join_path(dir, d.name);
      std::optional<ParsedManifest> pm;  // read once, for both questions
      try {
        pm = read_manifest(fs, path);
      } catch (...) {
      }
      StepState s{d.step, pm && files_as_listed(fs, path, *pm)};
      if (options.keep_last_among) {
        try {
          // A damaged checkpoint whose manifest names this run is this run's:
          // not counted (not valid), deleted once past the horizon.
          s.ours = pm && options.keep_last_among(pm->manifest);
        } catch (...) {
          s.ours = false;  // the predicate threw: when in doubt, keep it
        }
      }
      states.push_back(s);
    }
    std::vector<int64_t> expired = steps_to_delete(states, saved, keep_last);
    std::vector<std::string> trash;
    for (const StepDir& d : dirs) {
      if (std::find(expired.begin(), expired.end(), d.step) == expired.end()) continue;
      std::string to = join_path(dir, temp_dir_name(d.step, ::getpid(), "trash"));
      fs.rename(join_path(dir, d.name), to);
      trash.push_back(to);
    }
    if (trash.empty()) return;
    fs.sync_dir(dir);
    for (const std::string& t : trash) remove_all(fs, t);
    COHORT_INFO(kInit, "checkpoint: keep_last={} removed {} older checkpoint(s) from '{}'", keep_last, trash.size(), dir);
  } catch (const std::exception& e) {
    COHORT_WARN(kInit, "checkpoint: step {} is saved, but removing older checkpoints of '{}' (keep_last={}) failed: {}",
                saved, dir, keep_last, e.what());
  }
}

}  // namespace

namespace ckpt {

std::string checked_dir(const std::string& dir_arg, int64_t step, int keep_last, const char* who) {
  std::string dir = dir_arg;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  if (dir.empty()) throw InvalidArgument(fmt::format("{}: the checkpoint directory is empty; pass a path", who));
  if (step < 0) throw InvalidArgument(fmt::format("{}: step is {}; it must be >= 0", who, step));
  if (keep_last < 0)
    throw InvalidArgument(fmt::format("{}: keep_last is {}; use 0 to keep all, or N >= 1", who, keep_last));
  return dir;
}

std::map<std::string, EncodedHeader> checked_headers(const std::map<std::string, std::vector<NamedTensor>>& files,
                                                     const char* who) {
  std::map<std::string, EncodedHeader> headers;
  for (const auto& [name, tensors] : files) {
    check_file_name(name);
    try {
      headers[name] = encode_header(tensors, {{"format", "pt"}});
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format("{}: file \"{}\": {}", who, name, e.what()));
    }
  }
  return headers;
}

FileInfo write_tensor_file(Filesystem& fs, const std::string& dir, const std::string& name,
                           const EncodedHeader& header, const std::vector<NamedTensor>& tensors) {
  auto f = fs.create_file(join_path(dir, name + std::string(kTensorFileSuffix)));
  StreamStats stats = write_body(*f, header, tensors);
  f->sync();
  f->close();
  return FileInfo{stats.size, stats.crc32c};
}

// Step 2, and the temporary directory of step 3.
SaveInProgress::SaveInProgress(Filesystem& fs, std::string dir, int64_t step)
    : fs_(fs), dir_(std::move(dir)), step_(step) {
  // The directory, its writer lock (held to the end of this save), and the
  // leftovers of crashed saves: with the lock held no other save is under way,
  // so every temporary directory found is a crashed save's.
  make_dirs(fs_, dir_);
  lock_ = fs_.lock_dir(dir_);
  for (const std::string& t : list_temp_dirs(fs_, dir_)) {
    if (restore_moved_aside(fs_, dir_, t)) continue;
    // A leftover we cannot remove must not stop this save: it is logged and retried next time.
    COHORT_INFO(kInit, "checkpoint: removing '{}', left by an earlier save that did not finish", join_path(dir_, t));
    remove_quietly(fs_, join_path(dir_, t));
  }
  final_dir_ = join_path(dir_, step_dir_name(step_));
  tmp_dir_ = join_path(dir_, temp_dir_name(step_, ::getpid()));
  old_dir_ = join_path(dir_, temp_dir_name(step_, ::getpid(), "old"));
  fs_.create_dir(tmp_dir_);
}

SaveInProgress::~SaveInProgress() {
  if (!committed_) remove_quietly(fs_, tmp_dir_);
}

// Steps 4 to 6.
std::string SaveInProgress::commit(const Manifest& manifest, const std::map<std::string, FileInfo>& files,
                                   const SaveOptions& options) {
  std::map<std::string, FileInfo> infos;  // by full file name
  for (const auto& [name, info] : files) infos[name + std::string(kTensorFileSuffix)] = info;
  bool moved_old = false;
  try {
    // 4. The manifest, then the directory's entries.
    write_file(fs_, join_path(tmp_dir_, kManifestName), encode_manifest(step_, manifest, infos));
    fs_.sync_dir(tmp_dir_);
    // 5. Commit.
    if (fs_.exists(final_dir_)) {
      fs_.rename(final_dir_, old_dir_);
      moved_old = true;
    }
    fs_.rename(tmp_dir_, final_dir_);
    fs_.sync_dir(dir_);
    committed_ = true;
  } catch (...) {
    if (moved_old) {
      try {
        if (!fs_.exists(final_dir_)) fs_.rename(old_dir_, final_dir_);
      } catch (...) {
        // old_dir stays: the loader reads it under that name and the next save restores it.
      }
    }
    throw;  // the destructor removes the temporary directory
  }
  if (moved_old) {
    // Renamed to a trash name first: a "-old" name left behind (its removal
    // failed) would later be taken for a step moved aside by a crash and restored.
    const std::string trash = join_path(dir_, temp_dir_name(step_, ::getpid(), "trash"));
    try {
      fs_.rename(old_dir_, trash);
      remove_quietly(fs_, trash);
    } catch (const std::exception& e) {
      COHORT_WARN(kInit, "checkpoint: could not rename '{}' away after the new step {} was saved: {}", old_dir_, step_,
                  e.what());
    }
  }
  COHORT_INFO(kInit, "checkpoint: saved step {} to '{}'", step_, final_dir_);
  // 6. Retention.
  apply_retention(fs_, dir_, step_, options);
  return final_dir_;
}

}  // namespace ckpt

std::string save_checkpoint(const std::string& dir_arg, int64_t step,
                            const std::map<std::string, std::vector<NamedTensor>>& files, const Manifest& manifest,
                            const SaveOptions& options) {
  // 1. Everything that can be wrong with the arguments, before any write.
  const std::string dir = checked_dir(dir_arg, step, options.keep_last, "save_checkpoint");
  check_manifest(manifest);
  const std::map<std::string, EncodedHeader> headers = checked_headers(files, "save_checkpoint");
  Filesystem& fs = options.fs ? *options.fs : posix_filesystem();
  SaveInProgress save(fs, dir, step);  // 2.
  std::map<std::string, FileInfo> infos;
  for (const auto& [name, tensors] : files)  // 3. The tensor files.
    infos[name] = write_tensor_file(fs, save.tmp_dir(), name, headers.at(name), tensors);
  return save.commit(manifest, infos, options);  // 4-6.
}

}  // namespace cohort
