// The safetensors header: encoder and validating parser (pure functions).
//
// Format (from the safetensors project's own description, README "Format"):
//   8 bytes    N, unsigned 64-bit little-endian: the size of the header
//   N bytes    a UTF-8 JSON object: {"name": {"dtype": "F32", "shape": [2, 3],
//              "data_offsets": [begin, end]}, ..., "__metadata__": {str: str}}
//   the rest   the byte buffer; [begin, end) of each tensor is relative to its start
// The rules the parser enforces come from the same description: no duplicate
// keys, the buffer entirely indexed with no holes (and so no overlaps), scalars
// as shape [], empty tensors as zero-length ranges, a header of at most 100 MB.
// We write the header padded with spaces to a multiple of 8 and the tensors by
// element size, largest first, so every tensor is aligned to its element size.
#include <algorithm>
#include <bit>
#include <cstring>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.hpp"
#include "cohort/error.hpp"

static_assert(std::endian::native == std::endian::little,
              "cohort checkpoints copy tensor bytes as they are; a big-endian host would need byte swaps");

namespace cohort::ckpt {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

constexpr DType kAllDTypes[] = {DType::F32, DType::F64, DType::F16, DType::BF16,
                                DType::I8,  DType::U8,  DType::I32, DType::I64};

[[noreturn]] void bad(const std::string& file, const std::string& problem) {
  throw FormatError(fmt::format("safetensors file '{}': {}", file, problem));
}

// numel * itemsize, or false on overflow / negative dims.
bool byte_size(const std::vector<int64_t>& shape, DType dtype, uint64_t* out) {
  uint64_t n = dtype_size(dtype);
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
  }
  *out = n;
  return true;
}

std::string shape_str(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

// Parses JSON, rejecting duplicate keys at any level and nesting deeper than a header needs.
json parse_strict(std::string_view text, const std::string& file) {
  // The JSON parser would stop at a NUL and ignore what follows it.
  if (size_t nul = text.find('\0'); nul != std::string_view::npos)
    bad(file, fmt::format("the JSON header has a NUL byte at offset {}; padding after the JSON must be spaces", nul));
  std::vector<std::set<std::string>> keys;  // one set per open object
  auto on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth > 16) bad(file, "the JSON header nests deeper than 16 levels; a safetensors header needs 3");
    if (event == json::parse_event_t::object_start) keys.emplace_back();
    if (event == json::parse_event_t::object_end && !keys.empty()) keys.pop_back();
    if (event == json::parse_event_t::key && !keys.empty()) {
      const auto& k = parsed.get_ref<const std::string&>();
      if (!keys.back().insert(k).second) bad(file, fmt::format("the JSON header has the key \"{}\" twice", k));
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), on_event);
  } catch (const json::exception& e) {
    bad(file, fmt::format("the header is not valid JSON ({}): the file is corrupt or not a safetensors file", e.what()));
  }
}

uint64_t get_unsigned(const json& v, const std::string& file, const std::string& what) {
  if (!v.is_number_unsigned()) bad(file, fmt::format("{} must be a non-negative integer, not {}", what, v.dump()));
  return v.get<uint64_t>();
}

TensorEntry parse_entry(const std::string& name, const json& v, const std::string& file) {
  std::string where = fmt::format("tensor \"{}\"", name);
  if (!v.is_object()) bad(file, fmt::format("{} must be an object with dtype, shape and data_offsets", where));
  for (const char* key : {"dtype", "shape", "data_offsets"})
    if (!v.contains(key)) bad(file, fmt::format("{} has no \"{}\"", where, key));
  TensorEntry e;
  e.name = name;
  const json& dt = v["dtype"];
  std::string dt_name = dt.is_string() ? dt.get<std::string>() : dt.dump();
  auto it = std::find_if(std::begin(kAllDTypes), std::end(kAllDTypes),
                         [&](DType t) { return safetensors_dtype_name(t) == dt_name; });
  if (it == std::end(kAllDTypes))
    bad(file, fmt::format("{} has dtype {}, which cohort does not read (it reads F32, F64, F16, BF16, I8, U8, I32, I64)",
                          where, dt.dump()));
  e.dtype = *it;
  const json& shape = v["shape"];
  if (!shape.is_array()) bad(file, fmt::format("{}: shape must be an array, not {}", where, shape.dump()));
  for (const json& d : shape) {
    uint64_t dim = get_unsigned(d, file, where + ": each dimension of shape");
    if (dim > static_cast<uint64_t>(INT64_MAX)) bad(file, fmt::format("{}: dimension {} is too large", where, dim));
    e.shape.push_back(static_cast<int64_t>(dim));
  }
  const json& off = v["data_offsets"];
  if (!off.is_array() || off.size() != 2)
    bad(file, fmt::format("{}: data_offsets must be [begin, end], not {}", where, off.dump()));
  e.begin = get_unsigned(off[0], file, where + ": data_offsets[0]");
  e.end = get_unsigned(off[1], file, where + ": data_offsets[1]");
  if (e.end < e.begin) bad(file, fmt::format("{}: data_offsets [{}, {}] end before they begin", where, e.begin, e.end));
  uint64_t expect = 0;
  if (!byte_size(e.shape, e.dtype, &expect))
    bad(file, fmt::format("{}: shape {} x {} overflows 64 bits", where, shape_str(e.shape), dt_name));
  if (e.end - e.begin != expect)
    bad(file, fmt::format("{}: data_offsets [{}, {}] hold {} bytes but shape {} of {} needs {}", where, e.begin, e.end,
                          e.end - e.begin, shape_str(e.shape), dt_name, expect));
  return e;
}

}  // namespace

std::string_view safetensors_dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F64: return "F64";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::I8: return "I8";
    case DType::U8: return "U8";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
  }
  return "?";
}

EncodedHeader encode_header(const std::vector<NamedTensor>& tensors, const std::map<std::string, std::string>& metadata) {
  std::set<std::string_view> seen;
  for (const NamedTensor& t : tensors) {
    if (t.name.empty()) throw InvalidArgument("safetensors: a tensor has an empty name; give every tensor a name");
    if (t.name == "__metadata__")
      throw InvalidArgument("safetensors: \"__metadata__\" is reserved by the format and cannot name a tensor");
    if (!seen.insert(t.name).second)
      throw InvalidArgument(fmt::format("safetensors: two tensors are named \"{}\"; names must be unique", t.name));
    if (!dtype_is_valid(t.dtype))
      throw InvalidArgument(fmt::format("safetensors: tensor \"{}\" has an invalid dtype value {}", t.name,
                                        static_cast<int>(t.dtype)));
    uint64_t expect = 0;
    if (!byte_size(t.shape, t.dtype, &expect))
      throw InvalidArgument(fmt::format("safetensors: tensor \"{}\" has shape {}: dimensions must be >= 0 and the "
                                        "size must fit 64 bits", t.name, shape_str(t.shape)));
    if (t.bytes.size() != expect)
      throw InvalidArgument(fmt::format("safetensors: tensor \"{}\" ({} {}) needs {} bytes but has {}", t.name,
                                        dtype_name(t.dtype), shape_str(t.shape), expect, t.bytes.size()));
  }

  EncodedHeader out;
  out.order.resize(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) out.order[i] = i;
  std::sort(out.order.begin(), out.order.end(), [&](size_t a, size_t b) {
    size_t sa = dtype_size(tensors[a].dtype), sb = dtype_size(tensors[b].dtype);
    return sa != sb ? sa > sb : tensors[a].name < tensors[b].name;
  });

  ordered_json header = ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  for (size_t i : out.order) {
    const NamedTensor& t = tensors[i];
    uint64_t begin = out.data_bytes;
    out.data_bytes += t.bytes.size();
    header[t.name] = {{"dtype", safetensors_dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {begin, out.data_bytes}}};
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const ordered_json::exception& e) {
    throw InvalidArgument(fmt::format("safetensors: a tensor name or metadata string is not valid UTF-8 ({})", e.what()));
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  uint64_t n = text.size();
  out.bytes.resize(8);
  std::memcpy(out.bytes.data(), &n, 8);  // little-endian host (static_assert above)
  out.bytes += text;
  return out;
}

uint64_t parse_header_length(const uint8_t prefix[8], uint64_t file_size, const std::string& file) {
  if (file_size < 8)
    bad(file, fmt::format("the file has {} bytes, fewer than the 8-byte header length: it is truncated", file_size));
  uint64_t n;
  std::memcpy(&n, prefix, 8);
  if (n > kMaxHeaderBytes)
    bad(file, fmt::format("the header length field says {} bytes, over the format's 100 MiB limit: the file is "
                          "corrupt or not a safetensors file", n));
  if (n > file_size - 8)
    bad(file, fmt::format("the header length field says {} bytes but only {} bytes follow it: the file is truncated "
                          "or not a safetensors file", n, file_size - 8));
  if (n < 2) bad(file, fmt::format("the header length field says {} bytes, too short for a JSON object", n));
  return n;
}

ParsedHeader parse_header(std::string_view text, uint64_t data_bytes, const std::string& file) {
  if (text.empty() || text[0] != '{')
    bad(file, "the header does not start with '{': the file is corrupt or not a safetensors file");
  json root = parse_strict(text, file);
  if (!root.is_object()) bad(file, "the header is not a JSON object");
  ParsedHeader out;
  for (const auto& [key, value] : root.items()) {
    if (key != "__metadata__") {
      out.entries.push_back(parse_entry(key, value, file));
      continue;
    }
    if (!value.is_object()) bad(file, "\"__metadata__\" must be an object of strings");
    for (const auto& [mk, mv] : value.items()) {
      if (!mv.is_string()) bad(file, fmt::format("\"__metadata__\".\"{}\" must be a string, not {}", mk, mv.dump()));
      out.metadata[mk] = mv.get<std::string>();
    }
  }

  // The ranges must tile [0, data_bytes): sorted by begin, each starts where the previous ended.
  std::sort(out.entries.begin(), out.entries.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expect = 0;
  const TensorEntry* prev = nullptr;
  for (const TensorEntry& e : out.entries) {
    if (e.end > data_bytes)
      bad(file, fmt::format("tensor \"{}\": data_offsets [{}, {}] run past the end of the data ({} bytes): the file "
                            "is truncated", e.name, e.begin, e.end, data_bytes));
    if (e.begin < expect)
      bad(file, fmt::format("tensors \"{}\" [{}, {}] and \"{}\" [{}, {}] overlap", prev->name, prev->begin, prev->end,
                            e.name, e.begin, e.end));
    if (e.begin > expect)
      bad(file, fmt::format("bytes [{}, {}) before tensor \"{}\" belong to no tensor; the format allows no holes",
                            expect, e.begin, e.name));
    expect = e.end;
    prev = &e;
  }
  if (expect != data_bytes)
    bad(file, fmt::format("the last {} bytes of the file belong to no tensor (tensors end at data byte {} of {}); the "
                          "format allows no trailing bytes", data_bytes - expect, expect, data_bytes));
  return out;
}

}  // namespace cohort::ckpt
