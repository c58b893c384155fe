// load_checkpoint / load_latest_valid: reading a checkpoint back and proving it
// is the one that was written (sizes and CRC32C from manifest.json).
//
// A checkpoint directory is only ever visible after its save committed (see
// save.cpp), so a bad one means damage after the fact: a truncated copy, bit
// rot, a disk or file system that lost data despite fsync, someone's edit. The
// loader reports which file and how, and load_latest_valid falls back to the
// newest checkpoint that verifies.
#include <fmt/format.h>

#include <algorithm>

#include "checkpoint/agree.hpp"
#include "checkpoint/dir_scan.hpp"
#include "checkpoint/layout.hpp"
#include "checkpoint/safetensors.hpp"
#include "cohort/checkpoint.hpp"
#include "cohort/process_group.hpp"
#include "core/log.hpp"

namespace cohort {
namespace {

using namespace ckpt;

uint32_t whole_file_crc(ReadableFile& f) {
  constexpr size_t kChunk = size_t{4} << 20;
  std::vector<uint8_t> buf(kChunk);
  uint64_t size = f.size();
  uint32_t crc = 0;
  for (uint64_t off = 0; off < size; off += kChunk) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, size - off));
    f.read_at(off, buf.data(), n);
    crc = crc32c(buf.data(), n, crc);
  }
  return crc;
}

std::string checksum_message(const std::string& path, uint32_t got, uint32_t want) {
  return fmt::format("'{}': its CRC32C is {:08x} but the manifest says {:08x}: the file is corrupt (damaged on disk or "
                     "modified after the save); use an older checkpoint", path, got, want);
}

// The file exists with the manifest's size; returns it open.
std::unique_ptr<ReadableFile> check_size(Filesystem& fs, const std::string& path, const FileInfo& want) {
  if (!fs.exists(path))
    throw FormatError(fmt::format("'{}' is listed in the manifest but missing: the checkpoint was copied or cleaned "
                                  "up incompletely", path));
  auto f = fs.open_file(path);
  uint64_t size = f->size();
  if (size != want.size)
    throw FormatError(fmt::format("'{}' is {} bytes but the manifest says {}: the file is {} (a partial copy, a full "
                                  "disk, or damage after the save)", path, size, want.size,
                                  size < want.size ? "truncated" : "longer than written"));
  return f;
}

std::vector<NamedTensor> load_file(Filesystem& fs, const std::string& path, const FileInfo& want, bool verify) {
  auto f = check_size(fs, path, want);
  ReadResult r;
  try {
    r = read_body(*f, path, verify);
  } catch (const FormatError& e) {
    // A damaged header usually means a damaged file: say so when the checksum agrees.
    if (verify) {
      uint32_t got = whole_file_crc(*f);
      if (got != want.crc32c) throw FormatError(checksum_message(path, got, want.crc32c) + fmt::format(" ({})", e.what()));
    }
    throw;
  }
  if (verify && r.stats.crc32c != want.crc32c) throw FormatError(checksum_message(path, r.stats.crc32c, want.crc32c));
  return std::move(r.file.tensors);
}

// The manifest of the checkpoint at `path`, checked against its directory's
// name and options.required_files; the head of `out` filled from it.
ParsedManifest checked_manifest(Filesystem& fs, const std::string& path, const LoadOptions& options,
                                LoadedCheckpoint& out) {
  if (!fs.is_dir(path))
    throw IoError(fmt::format("checkpoint '{}' does not exist or is not a directory; pass a step_* directory, or use "
                              "load_latest_valid on the directory holding them", path));
  ParsedManifest pm = read_manifest(fs, path);
  std::string base = path.substr(path.find_last_of('/') == std::string::npos ? 0 : path.find_last_of('/') + 1);
  if (auto dir_step = parse_step_dir_name(base); dir_step && *dir_step != pm.step)
    throw FormatError(fmt::format("checkpoint '{}': the manifest says step {} but the directory is named for step {}; "
                                  "was it renamed by hand?", path, pm.step, *dir_step));
  for (const std::string& name : options.required_files)
    if (!pm.files.contains(name + std::string(kTensorFileSuffix))) {
      std::string have;
      for (const auto& [file, info] : pm.files) have += (have.empty() ? "" : ", ") + file;
      throw FormatError(fmt::format("checkpoint '{}' has no {}{} (its manifest lists: {}); it was written by another "
                                    "program or edited",
                                    path, name, kTensorFileSuffix, have.empty() ? "no files" : have));
    }
  out.path = path;
  out.step = pm.step;
  out.format_version = pm.format_version;
  out.manifest = std::move(pm.manifest);
  return pm;
}

std::string name_of(const std::string& file_name) { return file_name.substr(0, file_name.size() - kTensorFileSuffix.size()); }

}  // namespace

LoadedCheckpoint load_checkpoint(const std::string& path, const LoadOptions& options) {
  Filesystem& fs = options.fs ? *options.fs : posix_filesystem();
  LoadedCheckpoint out;
  ParsedManifest pm = checked_manifest(fs, path, options, out);
  for (const std::string& name : options.only_files)
    if (!pm.files.contains(name + std::string(kTensorFileSuffix)))
      throw FormatError(fmt::format("checkpoint '{}' has no {}{}, which was asked for (LoadOptions::only_files): it "
                                    "was written by another program, at another world size, or edited",
                                    path, name, kTensorFileSuffix));
  for (const auto& [file_name, info] : pm.files) {
    const std::string name = name_of(file_name);
    out.file_info[name] = info;  // every file the manifest lists, read or not
    const auto& only = options.only_files;
    if (!only.empty() && std::find(only.begin(), only.end(), name) == only.end()) {
      check_size(fs, join_path(path, file_name), info);
      continue;
    }
    out.files[name] = load_file(fs, join_path(path, file_name), info, options.verify_checksums);
  }
  return out;
}

std::optional<LoadedCheckpoint> load_latest_valid(const std::string& dir, const LoadOptions& options) {
  Filesystem& fs = options.fs ? *options.fs : posix_filesystem();
  std::vector<StepDir> dirs = list_step_dirs(fs, dir);
  std::vector<std::string> skipped;
  for (auto it = dirs.rbegin(); it != dirs.rend(); ++it) {
    std::string path = join_path(dir, it->name);
    try {
      LoadedCheckpoint c = load_checkpoint(path, options);
      if (!skipped.empty())
        COHORT_WARN(kInit, "checkpoint: loaded step {} from '{}' after skipping {} newer checkpoint(s) that failed "
                           "to verify", c.step, path, skipped.size());
      c.skipped = std::move(skipped);
      return c;
    } catch (const IoError& e) {
      COHORT_WARN(kInit, "checkpoint: skipping '{}': {}", path, e.what());
      skipped.push_back(fmt::format("{}: {}", it->name, e.what()));
    }
  }
  if (!skipped.empty())
    COHORT_WARN(kInit, "checkpoint: no valid checkpoint in '{}': all {} failed to verify (see above); starting from "
                       "scratch is up to the caller", dir, skipped.size());
  return std::nullopt;
}

std::optional<LoadedCheckpoint> find_latest_valid(ProcessGroup& world, const std::string& dir,
                                                  const std::function<std::string(const LoadedCheckpoint&)>& refuse,
                                                  const LoadOptions& options) {
  ProcessGroup& group = world.host_group();  // the ranks agree over host memory (nccl: its native twin)
  Filesystem& fs = options.fs ? *options.fs : posix_filesystem();
  const int rank = group.rank();
  const size_t n = static_cast<size_t>(group.size());
  // Rank 0's listing, so that every rank walks the same directories.
  std::string listing, error;
  if (rank == 0) {
    try {
      for (const StepDir& d : list_step_dirs(fs, dir)) listing += d.name + "\n";
    } catch (const std::exception& e) {  // every rank must reach the agreement below
      error = e.what();
    }
  }
  if (const auto [who, why] = first_error(group, error); who >= 0) throw IoError(why);
  listing = broadcast_string(group, listing, 0);
  std::vector<std::string> names;
  for (size_t at = 0, end; (end = listing.find('\n', at)) != std::string::npos; at = end + 1)
    names.push_back(listing.substr(at, end - at));

  std::vector<std::string> skipped;
  for (auto it = names.rbegin(); it != names.rend(); ++it) {
    const std::string path = join_path(dir, *it);
    LoadedCheckpoint c;
    std::string mine;  // "F<why>": it failed here; "R<why>": refused
    try {
      const ParsedManifest pm = checked_manifest(fs, path, options, c);
      size_t k = 0;
      for (const auto& [file_name, info] : pm.files) {
        c.file_info[name_of(file_name)] = info;
        if (k++ % n != static_cast<size_t>(rank)) continue;  // another rank's share
        const auto f = check_size(fs, join_path(path, file_name), info);
        if (!options.verify_checksums) continue;
        const uint32_t got = whole_file_crc(*f);
        if (got != info.crc32c) throw FormatError(checksum_message(join_path(path, file_name), got, info.crc32c));
      }
    } catch (const std::exception& e) {  // every rank must reach the agreement below
      mine = std::string("F") + e.what();
    }
    if (mine.empty() && refuse) {
      try {
        const std::string why = refuse(c);
        if (!why.empty()) mine = "R" + why;
      } catch (const std::exception& e) {  // the same: no rank may leave the agreement
        mine = std::string("F") + e.what();
      }
    }
    const auto [who, why] = first_error(group, mine);
    if (who < 0) {
      if (!skipped.empty() && rank == 0)
        COHORT_WARN(kInit, "checkpoint: chose step {} from '{}' after skipping {} newer checkpoint(s)", c.step, path,
                    skipped.size());
      c.skipped = std::move(skipped);
      return c;
    }
    const std::string reason = why.substr(1);
    if (rank == 0)
      COHORT_WARN(kInit, "checkpoint: skipping '{}': {}{}", path, why.front() == 'R' ? "refused: " : "", reason);
    skipped.push_back(fmt::format("{}: {}", *it, reason));
  }
  if (!skipped.empty() && rank == 0)
    COHORT_WARN(kInit, "checkpoint: no checkpoint in '{}' was chosen: all {} were skipped (see above)", dir,
                skipped.size());
  return std::nullopt;
}

std::vector<int64_t> list_checkpoint_steps(const std::string& dir, Filesystem* fs) {
  std::vector<int64_t> out;
  for (const StepDir& d : list_step_dirs(fs ? *fs : posix_filesystem(), dir)) out.push_back(d.step);
  return out;
}

}  // namespace cohort
