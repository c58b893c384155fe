// manifest.json: encoding and validating parsing (pure functions). The fields
// are listed in docs/checkpoint-format.md.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "cohort/checkpoint.hpp"

namespace cohort::ckpt {

// Throws InvalidArgument for world_size < 1, a negative epoch or sampler
// position, config that is not a JSON object, or lr_schedule that is not JSON.
void check_manifest(const Manifest& m);

// `files` is keyed by full file name ("model.safetensors").
std::string encode_manifest(int64_t step, const Manifest& m, const std::map<std::string, FileInfo>& files);

struct ParsedManifest {
  int format_version = 0;
  int64_t step = 0;
  Manifest manifest;
  std::map<std::string, FileInfo> files;  // by full file name, each checked with check_file_name
};

// Throws FormatError naming `path` for invalid JSON, a missing or mistyped
// field, "complete" not true, a newer format version, or an unsafe file name.
ParsedManifest parse_manifest(std::string_view text, const std::string& path);

}  // namespace cohort::ckpt
