// Whole-file reads for the dataset readers, with gzip detected by its magic
// number (1f 8b) rather than by the file name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace cohort::data {

// The file's bytes. IoError names the path and the OS error (missing file,
// permission, a directory, a read error).
std::vector<uint8_t> read_file_bytes(const std::string& path);

inline bool is_gzip(std::span<const uint8_t> bytes) {
  return bytes.size() >= 2 && bytes[0] == 0x1f && bytes[1] == 0x8b;
}

// Decompresses a gzip file (one or more concatenated members, as gzip -d does;
// trailing zero bytes are ignored). IoError naming `name` when the stream is
// corrupt, truncated or followed by other data.
//
// At most `limit` bytes come out: once that many are out before the end of the
// stream was seen, it stops there and sets *cut (when given); the rest of the
// stream is then not checked. Asking for one byte more than expected tells
// "too long" apart from "exactly right".
// A reader can thus inflate a header first and then bound the whole by what
// the header declares, so that a small damaged or hostile file cannot expand
// to gigabytes before it is rejected.
std::vector<uint8_t> gunzip(std::span<const uint8_t> compressed, const std::string& name, size_t limit = SIZE_MAX,
                            bool* cut = nullptr);

}  // namespace cohort::data
