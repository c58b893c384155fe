// Helpers for the checkpoint and safetensors tests: temporary directories,
// tensors of every dtype with small integer values (so sums are exact in any
// reader), and raw safetensors files built by hand for the malformed cases.
#pragma once

#include <stdlib.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "cohort/checkpoint.hpp"

namespace cohort::testing {

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "cohort_ckpt_XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline constexpr DType kEveryDType[] = {DType::F32, DType::F64, DType::F16, DType::BF16,
                                        DType::I8,  DType::U8,  DType::I32, DType::I64};

// Value i of the pattern: small integers (-5..5, or 0..10 for U8), exact in every dtype.
inline int64_t pattern_value(DType t, uint64_t i, int seed) {
  int64_t v = static_cast<int64_t>((i * 7 + static_cast<uint64_t>(seed)) % 11);
  return t == DType::U8 ? v : v - 5;
}

// float -> binary16 for values that are exact in it (small integers here).
inline uint16_t to_f16(float f) {
  uint32_t b = std::bit_cast<uint32_t>(f);
  uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000);
  if ((b & 0x7fffffff) == 0) return sign;
  int exp = static_cast<int>((b >> 23) & 0xff) - 127 + 15;
  return static_cast<uint16_t>(sign | (exp << 10) | ((b >> 13) & 0x3ff));
}

inline NamedTensor pattern_tensor(const std::string& name, DType t, std::vector<int64_t> shape, int seed = 0) {
  NamedTensor out{name, t, std::move(shape), {}};
  uint64_t n = out.numel();
  out.bytes.resize(n * dtype_size(t));
  uint8_t* p = out.bytes.data();
  for (uint64_t i = 0; i < n; ++i) {
    int64_t v = pattern_value(t, i, seed);
    auto put = [&](auto x) { std::memcpy(p + i * sizeof(x), &x, sizeof(x)); };
    switch (t) {
      case DType::F32: put(static_cast<float>(v)); break;
      case DType::F64: put(static_cast<double>(v)); break;
      case DType::F16: put(to_f16(static_cast<float>(v))); break;
      case DType::BF16: put(static_cast<uint16_t>(std::bit_cast<uint32_t>(static_cast<float>(v)) >> 16)); break;
      case DType::I8: put(static_cast<int8_t>(v)); break;
      case DType::U8: put(static_cast<uint8_t>(v)); break;
      case DType::I32: put(static_cast<int32_t>(v)); break;
      case DType::I64: put(v); break;
    }
  }
  return out;
}

inline double pattern_sum(const NamedTensor& t, int seed = 0) {
  double s = 0;
  for (uint64_t i = 0; i < t.numel(); ++i) s += static_cast<double>(pattern_value(t.dtype, i, seed));
  return s;
}

inline bool same_tensor(const NamedTensor& a, const NamedTensor& b) {
  return a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.bytes == b.bytes;
}

// Tensors of `want`, matched by name, equal to those of `got` (order free).
inline bool same_tensors(std::vector<NamedTensor> want, std::vector<NamedTensor> got) {
  auto by_name = [](const NamedTensor& a, const NamedTensor& b) { return a.name < b.name; };
  std::sort(want.begin(), want.end(), by_name);
  std::sort(got.begin(), got.end(), by_name);
  if (want.size() != got.size()) return false;
  for (size_t i = 0; i < want.size(); ++i)
    if (!same_tensor(want[i], got[i])) return false;
  return true;
}

// A safetensors file from a header text and a data buffer, exactly as given.
inline std::vector<uint8_t> raw_safetensors(const std::string& header, const std::string& data,
                                            std::optional<uint64_t> length_field = std::nullopt) {
  uint64_t n = length_field.value_or(header.size());
  std::string s(8, '\0');
  std::memcpy(s.data(), &n, 8);
  s += header;
  s += data;
  return std::vector<uint8_t>(s.begin(), s.end());
}

inline std::vector<uint8_t> read_bytes(const std::string& path) {
  auto f = posix_filesystem().open_file(path);
  std::vector<uint8_t> out(f->size());
  if (!out.empty()) f->read_at(0, out.data(), out.size());
  return out;
}

inline void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  auto f = posix_filesystem().create_file(path);
  f->append(bytes.data(), bytes.size());
  f->close();
}

}  // namespace cohort::testing
