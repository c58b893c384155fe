// safetensors internals: the pure header encoder and validating parser, and the
// streaming writer and reader over the Filesystem seam (used by the public
// functions in cohort/checkpoint.hpp and by checkpoint save/load, which also
// need each file's size and CRC32C computed on the way through).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "cohort/checkpoint.hpp"
#include "cohort/filesystem.hpp"

namespace cohort::ckpt {

// The reference implementation's cap on the JSON header; bigger is not a real file.
inline constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

std::string_view safetensors_dtype_name(DType t);  // "F32", "BF16", ...

// One tensor as the header describes it; offsets are relative to the data buffer.
struct TensorEntry {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

struct ParsedHeader {
  std::vector<TensorEntry> entries;  // sorted by begin: they tile [0, data_bytes) exactly
  std::map<std::string, std::string> metadata;
};

struct EncodedHeader {
  std::string bytes;          // 8-byte little-endian length + JSON padded with spaces to a multiple of 8
  std::vector<size_t> order;  // indices into the tensors, in data order
  uint64_t data_bytes = 0;    // size of the byte buffer after the header
};

// Validates the tensors (throws InvalidArgument naming the tensor) and lays them out.
EncodedHeader encode_header(const std::vector<NamedTensor>& tensors, const std::map<std::string, std::string>& metadata);

// Checks the 8-byte length prefix against the file size; returns N. Throws FormatError naming `file`.
uint64_t parse_header_length(const uint8_t prefix[8], uint64_t file_size, const std::string& file);
// Parses and validates N bytes of JSON header, given the size of the data buffer after it.
ParsedHeader parse_header(std::string_view json, uint64_t data_bytes, const std::string& file);

struct StreamStats {
  uint64_t size = 0;
  uint32_t crc32c = 0;
};

// Appends the whole file to `out` (header, then tensor bytes in header.order).
StreamStats write_body(WritableFile& out, const EncodedHeader& header, const std::vector<NamedTensor>& tensors);

struct ReadResult {
  SafetensorsFile file;
  StreamStats stats;  // crc32c only if compute_crc
};

// Reads and validates a whole file; `name` is used in errors. Memory is bounded by in.size().
ReadResult read_body(ReadableFile& in, const std::string& name, bool compute_crc);

}  // namespace cohort::ckpt
