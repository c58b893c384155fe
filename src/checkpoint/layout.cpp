#include "checkpoint/layout.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "cohort/error.hpp"

namespace cohort::ckpt {

std::string step_dir_name(int64_t step) { return fmt::format("step_{:09d}", step); }

std::optional<int64_t> parse_step_dir_name(std::string_view name) {
  constexpr std::string_view kPrefix = "step_";
  if (!name.starts_with(kPrefix) || name.size() == kPrefix.size() || name.size() > kPrefix.size() + 19)
    return std::nullopt;
  int64_t step = 0;
  for (char c : name.substr(kPrefix.size())) {
    if (c < '0' || c > '9') return std::nullopt;
    if (__builtin_mul_overflow(step, 10, &step) || __builtin_add_overflow(step, c - '0', &step)) return std::nullopt;
  }
  // Only the name step_dir_name() gives: "step_10" beside "step_000000010"
  // would be two directories for one step.
  if (name != step_dir_name(step)) return std::nullopt;
  return step;
}

std::optional<int64_t> parse_moved_aside_name(std::string_view name) {
  const size_t tmp = name.find(".tmp-");
  if (tmp == std::string_view::npos || !name.ends_with("-old")) return std::nullopt;
  return parse_step_dir_name(name.substr(0, tmp));
}

bool is_temp_name(std::string_view name) { return name.find(".tmp-") != std::string_view::npos; }

std::string temp_dir_name(int64_t step, long pid, std::string_view tag) {
  return tag.empty() ? fmt::format("{}.tmp-{}", step_dir_name(step), pid)
                     : fmt::format("{}.tmp-{}-{}", step_dir_name(step), pid, tag);
}

void check_file_name(std::string_view name) {
  bool ok = !name.empty() && name.size() <= 200 && name[0] != '.' && name != "manifest";
  for (char c : name)
    ok = ok && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
                c == '.');
  if (!ok)
    throw InvalidArgument(fmt::format("checkpoint file name \"{}\" is not allowed: use 1-200 letters, digits, '_', "
                                      "'-' or '.', not starting with '.', and not \"manifest\" (e.g. \"model\", "
                                      "\"optimizer\")", name));
}

std::vector<int64_t> steps_to_delete(std::vector<StepState> existing, int64_t saved, int keep_last) {
  if (keep_last <= 0) return {};
  std::sort(existing.begin(), existing.end(), [](const StepState& a, const StepState& b) { return a.step > b.step; });
  int kept = 0;
  std::optional<int64_t> horizon;  // the oldest step kept
  for (const StepState& s : existing) {
    if (s.step > saved || !s.valid || !s.ours) continue;
    if (kept < keep_last) {
      ++kept;
      horizon = s.step;
    }
  }
  std::vector<int64_t> out;
  if (kept < keep_last || !horizon) return out;  // fewer than keep_last valid: nothing is old enough
  for (const StepState& s : existing)
    if (s.step < *horizon && s.ours) out.push_back(s.step);
  return out;
}

}  // namespace cohort::ckpt
