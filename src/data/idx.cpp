// IDX reader (the MNIST family's format).
//
//   bytes 0-1   00 00
//   byte  2     element type: 08 u8, 09 i8, 0b i16, 0c i32, 0d f32, 0e f64
//   byte  3     number of dimensions, ndims
//   then        ndims sizes, big-endian u32 each
//   then        the elements, row-major (big-endian when wider than a byte)
//
// Every check names the file and says what it found and what it expected: a
// truncated download is the usual culprit, and its message must say so.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdint>
#include <optional>
#include <string_view>

#include "cohort/data.hpp"
#include "cohort/error.hpp"
#include "data/file_bytes.hpp"

namespace cohort::data {
namespace {

constexpr uint8_t kTypeU8 = 0x08;
constexpr std::string_view kAfterGunzip = " (after gunzip)";  // added to the name of a .gz file's contents

const char* type_name(uint8_t type) {
  switch (type) {
    case 0x08: return "u8";
    case 0x09: return "i8";
    case 0x0b: return "i16";
    case 0x0c: return "i32";
    case 0x0d: return "f32";
    case 0x0e: return "f64";
    default: return nullptr;
  }
}

uint32_t read_be32(const uint8_t* p) {
  return uint32_t{p[0]} << 24 | uint32_t{p[1]} << 16 | uint32_t{p[2]} << 8 | uint32_t{p[3]};
}

constexpr size_t kMaxHeader = 4 + 4 * 255;  // ndims is one byte

// Validates the header (magic, type, dimensions); fills dims and numel
// (nullopt: more than 2^64 elements) and returns the header's size.
size_t check_idx_header(std::span<const uint8_t> bytes, const std::string& name, std::vector<int64_t>& dims,
                        std::optional<uint64_t>& numel) {
  if (bytes.size() < 4)
    throw IoError(fmt::format("{}: not an IDX file: it has {} bytes, fewer than the 4-byte magic number "
                              "00 00 <type> <ndims>; is it the right file, completely downloaded?",
                              name, bytes.size()));
  if (bytes[0] != 0 || bytes[1] != 0)
    throw IoError(fmt::format("{}: not an IDX file: it starts with {:02x} {:02x} {:02x} {:02x}, expected 00 00 "
                              "<type> <ndims>{}; is it the right file?",
                              name, bytes[0], bytes[1], bytes[2], bytes[3],
                              !is_gzip(bytes) ? ""
                              : name.ends_with(kAfterGunzip)
                                  ? " (these bytes are gzip data again: the file was compressed twice; gunzip it once "
                                    "and read the result)"
                                  : " (these bytes are gzip data: read the file with read_idx)"));
  const uint8_t type = bytes[2];
  if (type != kTypeU8) {
    const char* known = type_name(type);
    if (known == nullptr)
      throw IoError(fmt::format("{}: not an IDX file: element type byte is 0x{:02x}, expected one of 08 09 0b 0c "
                                "0d 0e (and cohort reads 08, u8)",
                                name, type));
    throw IoError(fmt::format("{}: IDX element type 0x{:02x} ({}) is not supported; cohort reads u8 (0x08) IDX "
                              "files only, like MNIST and Fashion-MNIST",
                              name, type, known));
  }
  const size_t ndims = bytes[3];
  if (ndims == 0)
    throw IoError(fmt::format("{}: the IDX header declares 0 dimensions; expected at least 1 (labels have 1, "
                              "images 3)",
                              name));
  const size_t header = 4 + 4 * ndims;
  if (bytes.size() < header)
    throw IoError(fmt::format("{}: truncated IDX header: {} dimensions need a {}-byte header, the file has {} "
                              "bytes; download or reinstall it",
                              name, ndims, header, bytes.size()));

  dims.clear();
  uint64_t n = 1;
  bool too_big = false;
  for (size_t d = 0; d < ndims; ++d) {
    const uint32_t dim = read_be32(bytes.data() + 4 + 4 * d);
    dims.push_back(dim);
    too_big = too_big || __builtin_mul_overflow(n, uint64_t{dim}, &n);
  }
  numel = too_big ? std::nullopt : std::optional<uint64_t>(n);
  return header;
}

// Validates the header against the file's length; fills dims and returns the header's size.
size_t check_idx(std::span<const uint8_t> bytes, const std::string& name, std::vector<int64_t>& dims) {
  std::optional<uint64_t> declared;
  const size_t header = check_idx_header(bytes, name, dims, declared);
  const bool too_big = !declared;
  const uint64_t numel = declared.value_or(0);
  const size_t found = bytes.size() - header;
  if (too_big || numel != found)
    throw IoError(fmt::format(
        "{}: expected {} bytes of data after the {}-byte header ({} u8 elements), found {}{}; the file is "
        "truncated or not what its header says: download or reinstall it",
        name, too_big ? std::string("more than 2^64") : std::to_string(numel), header,
        fmt::join(dims, "x"), found,
        (!too_big && found > numel) ? fmt::format(" ({} bytes too many)", found - numel) : std::string()));
  return header;
}

}  // namespace

IdxArray parse_idx(std::span<const uint8_t> bytes, const std::string& name) {
  IdxArray out;
  const size_t header = check_idx(bytes, name, out.dims);
  out.data.assign(bytes.begin() + static_cast<std::ptrdiff_t>(header), bytes.end());
  return out;
}

IdxArray read_idx(const std::string& path) {
  std::vector<uint8_t> bytes = read_file_bytes(path);
  std::string name = path;
  if (is_gzip(bytes)) {
    name += kAfterGunzip;
    // The header first, then no more than it declares (and one byte to see an
    // excess): a small damaged or hostile .gz must not expand to gigabytes
    // before it is rejected.
    std::vector<int64_t> dims;
    std::optional<uint64_t> numel;
    const size_t header = check_idx_header(gunzip(bytes, path, kMaxHeader), name, dims, numel);
    // Deflate expands at most ~1032:1: a header declaring more than that is refused before inflating.
    const uint64_t most = static_cast<uint64_t>(bytes.size()) * 1032 + 1024;
    if (!numel || *numel > most)
      throw IoError(fmt::format("{}: its header declares {} u8 elements ({}), more than {} compressed bytes can hold; "
                                "the file is damaged or not what its header says: download or reinstall it",
                                name, numel ? std::to_string(*numel) : std::string("more than 2^64"),
                                fmt::join(dims, "x"), bytes.size()));
    const uint64_t limit = header + *numel;
    bool cut = false;
    bytes = gunzip(bytes, path, limit + 1, &cut);
    if (cut)
      throw IoError(fmt::format("{}: the data goes on past the {} bytes its header declares ({}-byte header + {} u8 "
                                "elements); the file is damaged or not what its header says: download or reinstall it",
                                name, limit, header, fmt::join(dims, "x")));
  }
  IdxArray out;
  const size_t header = check_idx(bytes, name, out.dims);
  bytes.erase(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(header));  // in place: no second copy
  out.data = std::move(bytes);
  return out;
}

}  // namespace cohort::data
