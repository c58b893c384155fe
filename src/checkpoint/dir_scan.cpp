#include "checkpoint/dir_scan.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "checkpoint/layout.hpp"
#include "cohort/checkpoint.hpp"

namespace cohort::ckpt {

std::string join_path(const std::string& dir, std::string_view name) {
  if (dir.empty()) return std::string(name);
  return dir.back() == '/' ? dir + std::string(name) : dir + "/" + std::string(name);
}

std::vector<StepDir> list_step_dirs(Filesystem& fs, const std::string& dir) {
  std::vector<StepDir> out;
  if (!fs.is_dir(dir)) return out;
  std::vector<StepDir> aside;
  for (const DirEntry& e : fs.list_dir(dir)) {
    if (!e.is_dir) continue;
    if (auto step = parse_step_dir_name(e.name)) out.push_back({*step, e.name});
    else if (auto moved = parse_moved_aside_name(e.name)) aside.push_back({*moved, e.name});
  }
  // A save of step X that crashed between its two renames left the committed
  // step X only under its moved-aside name: it counts until a save restores it.
  for (const StepDir& a : aside)
    if (std::none_of(out.begin(), out.end(), [&](const StepDir& d) { return d.step == a.step && !d.moved_aside; }))
      out.push_back({a.step, a.name, true});
  std::sort(out.begin(), out.end(),
            [](const StepDir& a, const StepDir& b) { return a.step != b.step ? a.step < b.step : a.name < b.name; });
  return out;
}

std::vector<std::string> list_temp_dirs(Filesystem& fs, const std::string& dir) {
  std::vector<std::string> out;
  if (!fs.is_dir(dir)) return out;
  for (const DirEntry& e : fs.list_dir(dir))
    if (is_temp_name(e.name) && (e.is_dir || fs.is_symlink(join_path(dir, e.name)))) out.push_back(e.name);
  std::sort(out.begin(), out.end());
  return out;
}

ParsedManifest read_manifest(Filesystem& fs, const std::string& step_dir) {
  constexpr uint64_t kMaxManifestBytes = uint64_t{64} << 20;
  std::string path = join_path(step_dir, kManifestName);
  if (!fs.exists(path))
    throw FormatError(fmt::format("checkpoint '{}' has no {}: its save never finished, or this is not a checkpoint "
                                  "directory", step_dir, kManifestName));
  auto f = fs.open_file(path);
  uint64_t size = f->size();
  if (size > kMaxManifestBytes)
    throw FormatError(fmt::format("checkpoint manifest '{}' is {} bytes, over the 64 MiB limit: it is corrupt", path,
                                  size));
  std::string text(size, '\0');
  f->read_at(0, text.data(), text.size());
  return parse_manifest(text, path);
}

bool files_as_listed(Filesystem& fs, const std::string& step_dir, const ParsedManifest& pm) noexcept {
  try {
    for (const auto& [name, info] : pm.files) {
      const std::string path = join_path(step_dir, name);
      if (!fs.exists(path) || fs.open_file(path)->size() != info.size) return false;
    }
    return true;
  } catch (...) {
    return false;
  }
}


}  // namespace cohort::ckpt
