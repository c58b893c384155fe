#include <algorithm>
#include <cctype>
#include <string>

#include <fmt/format.h>

#include "cohort/error.hpp"
#include "cohort/types.hpp"

namespace cohort {

bool dtype_is_valid(DType t) { return static_cast<int>(t) < kNumDTypes; }
bool reduce_op_is_valid(ReduceOp op) { return static_cast<int>(op) < kNumReduceOps; }

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::I8: return 1;
    case DType::U8: return 1;
    case DType::I32: return 4;
    case DType::I64: return 8;
  }
  throw InvalidArgument(fmt::format("unknown dtype value {}; use one of f32, f64, f16, bf16, i8, u8, i32, i64",
                                    static_cast<int>(t)));
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::F64: return "f64";
    case DType::F16: return "f16";
    case DType::BF16: return "bf16";
    case DType::I8: return "i8";
    case DType::U8: return "u8";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
  }
  return "?";
}

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Prod: return "prod";
    case ReduceOp::Min: return "min";
    case ReduceOp::Max: return "max";
    case ReduceOp::Avg: return "avg";
  }
  return "?";
}

std::optional<DType> parse_dtype(std::string_view s) {
  std::string l(s);
  std::transform(l.begin(), l.end(), l.begin(), [](unsigned char c) { return std::tolower(c); });
  if (l == "f32" || l == "float" || l == "float32") return DType::F32;
  if (l == "f64" || l == "double" || l == "float64") return DType::F64;
  if (l == "f16" || l == "half" || l == "float16") return DType::F16;
  if (l == "bf16" || l == "bfloat16") return DType::BF16;
  if (l == "i8" || l == "int8") return DType::I8;
  if (l == "u8" || l == "uint8") return DType::U8;
  if (l == "i32" || l == "int" || l == "int32") return DType::I32;
  if (l == "i64" || l == "int64" || l == "long") return DType::I64;
  return std::nullopt;
}

std::optional<ReduceOp> parse_reduce_op(std::string_view s) {
  std::string l(s);
  std::transform(l.begin(), l.end(), l.begin(), [](unsigned char c) { return std::tolower(c); });
  if (l == "sum") return ReduceOp::Sum;
  if (l == "prod") return ReduceOp::Prod;
  if (l == "min") return ReduceOp::Min;
  if (l == "max") return ReduceOp::Max;
  if (l == "avg" || l == "mean") return ReduceOp::Avg;
  return std::nullopt;
}

}  // namespace cohort
