// cohort/types.hpp: element types, reduction operations and typed buffer views.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>
#include "cohort/export.hpp"

namespace cohort {

// Element types a collective can move. The numbering is part of the wire format
// (it travels in message headers), so only append.
enum class DType : uint8_t { F32 = 0, F64 = 1, F16 = 2, BF16 = 3, I8 = 4, U8 = 5, I32 = 6, I64 = 7 };
inline constexpr int kNumDTypes = 8;

enum class ReduceOp : uint8_t { Sum = 0, Prod = 1, Min = 2, Max = 3, Avg = 4 };
inline constexpr int kNumReduceOps = 5;

// Size in bytes of one element; throws InvalidArgument for a value outside the enum.
COHORT_API size_t dtype_size(DType t);
// "f32", "bf16", ...; "?" for a value outside the enum.
COHORT_API std::string_view dtype_name(DType t);
COHORT_API std::string_view reduce_op_name(ReduceOp op);
// Accepts our names and the usual aliases (float, float32, half, double, int, ...).
COHORT_API std::optional<DType> parse_dtype(std::string_view s);
COHORT_API std::optional<ReduceOp> parse_reduce_op(std::string_view s);
COHORT_API bool dtype_is_valid(DType t);
COHORT_API bool reduce_op_is_valid(ReduceOp op);

// A contiguous run of `count` elements of `dtype` at `data`. It does not own the
// memory; the caller keeps it alive until the collective's Work completes.
struct COHORT_API Buffer {
  void* data = nullptr;
  size_t count = 0;
  DType dtype = DType::F32;

  size_t bytes() const { return count * dtype_size(dtype); }
};

// Elements of an allreduce_gathered input (ProcessGroup) that are not in its buffer yet.
struct COHORT_API InputPiece {
  size_t offset = 0;           // first element, in the buffer
  size_t count = 0;            // elements
  const void* data = nullptr;  // where they are now
};

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<double>() { return DType::F64; }
template <> constexpr DType dtype_of<int8_t>() { return DType::I8; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::U8; }
template <> constexpr DType dtype_of<int32_t>() { return DType::I32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::I64; }

template <class T> Buffer buffer(std::span<T> s) { return Buffer{s.data(), s.size(), dtype_of<T>()}; }
template <class T> Buffer buffer(std::vector<T>& v) { return Buffer{v.data(), v.size(), dtype_of<T>()}; }
inline Buffer buffer(void* data, size_t count, DType dtype) { return Buffer{data, count, dtype}; }

}  // namespace cohort
