#include "checkpoint/manifest.hpp"

#include <algorithm>
#include <charconv>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "checkpoint/base64.hpp"
#include "checkpoint/layout.hpp"
#include "cohort/checkpoint.hpp"
#include "cohort/error.hpp"

namespace cohort::ckpt {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

constexpr std::string_view kFormatName = "cohort-checkpoint";
// The manifest's own checksum (format_version 2): CRC32C of the file's bytes
// with these 8 hex digits written as "00000000". Written last, so that the
// placeholder and the value have the same length and position.
constexpr std::string_view kCrcKey = "manifest_crc32c";
constexpr std::string_view kCrcPlaceholder = "00000000";
constexpr int kMaxDepth = 64;  // the free-form config and lr_schedule may nest, not without bound

[[noreturn]] void bad(const std::string& path, const std::string& problem) {
  throw FormatError(fmt::format("checkpoint manifest '{}': {}", path, problem));
}

const json& field(const json& root, const char* key, const std::string& path) {
  auto it = root.find(key);
  if (it == root.end()) bad(path, fmt::format("the field \"{}\" is missing", key));
  return *it;
}

int64_t int_field(const json& root, const char* key, const std::string& path) {
  const json& v = field(root, key, path);
  if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)))
    bad(path, fmt::format("\"{}\" must be an integer, not {}", key, v.dump()));
  return v.get<int64_t>();
}

// Format 2: the manifest's bytes match the CRC32C it carries.
void check_own_crc(std::string_view text, const json& value, const std::string& path) {
  std::optional<uint32_t> want;
  if (value.is_string() && value.get_ref<const std::string&>().size() == 8) {
    const std::string& hex = value.get_ref<const std::string&>();
    uint32_t v = 0;
    auto [p, ec] = std::from_chars(hex.data(), hex.data() + hex.size(), v, 16);
    if (ec == std::errc() && p == hex.data() + hex.size()) want = v;
  }
  if (!want) bad(path, fmt::format("\"{}\" must be 8 hex digits, not {}", kCrcKey, value.dump()));
  const std::string field = fmt::format("\"{}\": \"{:08x}\"", kCrcKey, *want);
  const size_t at = text.rfind(field);
  if (at == std::string_view::npos || text.find(field) != at)
    bad(path, fmt::format("\"{}\" is not written the way cohort writes it: was the file edited by hand?", kCrcKey));
  std::string zeroed(text);
  zeroed.replace(at + field.size() - 1 - kCrcPlaceholder.size(), kCrcPlaceholder.size(), kCrcPlaceholder);
  const uint32_t got = crc32c(zeroed.data(), zeroed.size(), 0);
  if (got != *want)
    bad(path, fmt::format("its CRC32C is {:08x} but it says {:08x}: the file is corrupt (damaged on disk or modified "
                          "after the save); use an older checkpoint",
                          got, *want));
}

}  // namespace

void check_manifest(const Manifest& m) {
  if (m.world_size < 1)
    throw InvalidArgument(fmt::format("checkpoint manifest: world_size is {}; it must be at least 1", m.world_size));
  if (m.epoch < 0 || m.sampler_position < 0)
    throw InvalidArgument(fmt::format("checkpoint manifest: epoch ({}) and sampler_position ({}) must be >= 0",
                                      m.epoch, m.sampler_position));
  json config = json::parse(m.config, nullptr, /*allow_exceptions=*/false);
  if (!config.is_object())
    throw InvalidArgument(fmt::format("checkpoint manifest: config must be the text of a JSON object (e.g. "
                                      "{{\"lr\": 0.1}}), not '{}'", m.config.substr(0, 200)));
  // What parse_manifest accepts back (its depth limit), checked before anything is written.
  for (const std::string* text : {&m.config, &m.lr_schedule}) {
    int deepest = 0;
    const json::parser_callback_t depth = [&](int d, json::parse_event_t, json&) {
      deepest = std::max(deepest, d);
      return true;
    };
    const json parsed = json::parse(*text, depth, /*allow_exceptions=*/false);  // kept: parse is [[nodiscard]]
    (void)parsed;
    if (deepest > kMaxDepth - 2)
      throw InvalidArgument(fmt::format("checkpoint manifest: config and lr_schedule may nest at most {} levels",
                                        kMaxDepth - 2));
  }
  json lr = json::parse(m.lr_schedule, nullptr, /*allow_exceptions=*/false);
  if (lr.is_discarded())
    throw InvalidArgument(fmt::format("checkpoint manifest: lr_schedule must be JSON text (e.g. {{\"last_epoch\": "
                                      "3}}), not '{}'", m.lr_schedule.substr(0, 200)));
}

std::string encode_manifest(int64_t step, const Manifest& m, const std::map<std::string, FileInfo>& files) {
  ordered_json j;
  j["format"] = kFormatName;
  j["format_version"] = kFormatVersion;
  j["step"] = step;
  j["epoch"] = m.epoch;
  j["sampler_position"] = m.sampler_position;
  j["world_size"] = m.world_size;
  ordered_json rng = ordered_json::object();
  for (const auto& [name, state] : m.rng_states) rng[name] = base64_encode(state);
  j["rng_states"] = rng;
  j["lr_schedule"] = ordered_json::parse(m.lr_schedule);
  j["config"] = ordered_json::parse(m.config);
  ordered_json f = ordered_json::object();
  for (const auto& [name, info] : files) f[name] = {{"size", info.size}, {"crc32c", fmt::format("{:08x}", info.crc32c)}};
  j["files"] = f;
  j["writer"] = "cohort " COHORT_VERSION;
  j["complete"] = true;
  j[std::string(kCrcKey)] = std::string(kCrcPlaceholder);
  std::string text;
  try {
    text = j.dump(2) + "\n";
  } catch (const ordered_json::exception& e) {
    throw InvalidArgument(fmt::format("checkpoint manifest: an RNG state name is not valid UTF-8 ({})", e.what()));
  }
  const std::string field = fmt::format("\"{}\": \"{}\"", kCrcKey, kCrcPlaceholder);
  const size_t at = text.rfind(field);
  const uint32_t crc = crc32c(text.data(), text.size(), 0);
  text.replace(at + field.size() - 1 - kCrcPlaceholder.size(), kCrcPlaceholder.size(), fmt::format("{:08x}", crc));
  return text;
}

ParsedManifest parse_manifest(std::string_view text, const std::string& path) {
  constexpr const char* kCorrupt = "the file is corrupt (the save completed, so the disk or a later writer damaged it)";
  if (text.find('\0') != std::string_view::npos) bad(path, fmt::format("it contains a NUL byte: {}", kCorrupt));
  bool too_deep = false;
  const json::parser_callback_t depth_limit = [&](int depth, json::parse_event_t, json&) {
    too_deep = too_deep || depth > kMaxDepth;
    return !too_deep;
  };
  json root = json::parse(text.begin(), text.end(), depth_limit, /*allow_exceptions=*/false);
  if (too_deep) bad(path, fmt::format("it nests deeper than {} levels: {}", kMaxDepth, kCorrupt));
  if (root.is_discarded() || !root.is_object()) bad(path, fmt::format("not a JSON object: {}", kCorrupt));
  ParsedManifest out;
  const json& format = field(root, "format", path);
  if (format != std::string(kFormatName)) bad(path, fmt::format("\"format\" is {}, not \"{}\"", format.dump(), kFormatName));
  out.format_version = static_cast<int>(int_field(root, "format_version", path));
  if (out.format_version < 1 || out.format_version > kFormatVersion)
    bad(path, fmt::format("format_version {} is not one this cohort reads (1..{}): it was written by a newer cohort; "
                          "upgrade cohort to load it", out.format_version, kFormatVersion));
  const json& complete = field(root, "complete", path);
  if (complete != true) bad(path, "\"complete\" is not true: the save that wrote it did not finish");
  if (out.format_version >= 2) check_own_crc(text, field(root, std::string(kCrcKey).c_str(), path), path);
  out.step = int_field(root, "step", path);
  Manifest& m = out.manifest;
  m.epoch = int_field(root, "epoch", path);
  m.sampler_position = int_field(root, "sampler_position", path);
  if (out.step < 0 || m.epoch < 0 || m.sampler_position < 0)
    bad(path, fmt::format("step ({}), epoch ({}) and sampler_position ({}) must be >= 0", out.step, m.epoch,
                          m.sampler_position));
  int64_t world = int_field(root, "world_size", path);
  if (world < 1 || world > INT32_MAX) bad(path, fmt::format("world_size {} is out of range", world));
  m.world_size = static_cast<int>(world);
  const json& rng = field(root, "rng_states", path);
  if (!rng.is_object()) bad(path, "\"rng_states\" must be an object of base64 strings");
  for (const auto& [name, v] : rng.items()) {
    std::optional<std::string> bytes = v.is_string() ? base64_decode(v.get_ref<const std::string&>()) : std::nullopt;
    if (!bytes) bad(path, fmt::format("rng_states.\"{}\" is not a base64 string", name));
    m.rng_states[name] = std::move(*bytes);
  }
  m.lr_schedule = field(root, "lr_schedule", path).dump();
  const json& config = field(root, "config", path);
  if (!config.is_object()) bad(path, "\"config\" must be a JSON object");
  m.config = config.dump();
  const json& files = field(root, "files", path);
  if (!files.is_object()) bad(path, "\"files\" must be an object");
  for (const auto& [name, v] : files.items()) {
    std::string_view stem = name;
    bool ok = stem.ends_with(kTensorFileSuffix);
    if (ok) {
      stem.remove_suffix(kTensorFileSuffix.size());
      try {
        check_file_name(stem);
      } catch (const InvalidArgument&) {
        ok = false;
      }
    }
    if (!ok) bad(path, fmt::format("\"files\" lists \"{}\", which is not a <name>.safetensors file name", name));
    const json& size = v.is_object() ? field(v, "size", path) : v;
    const json& crc = v.is_object() ? field(v, "crc32c", path) : v;
    uint32_t crc_value = 0;
    bool crc_ok = crc.is_string() && crc.get_ref<const std::string&>().size() == 8;
    if (crc_ok) {
      const std::string& s = crc.get_ref<const std::string&>();
      auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), crc_value, 16);
      crc_ok = ec == std::errc() && p == s.data() + s.size();
    }
    if (!size.is_number_unsigned() || !crc_ok)
      bad(path, fmt::format("files.\"{}\" must be {{\"size\": <bytes>, \"crc32c\": \"<8 hex digits>\"}}, not {}", name,
                            v.dump()));
    out.files[name] = FileInfo{size.get<uint64_t>(), crc_value};
  }
  return out;
}

}  // namespace cohort::ckpt
