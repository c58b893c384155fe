// One element of a typed buffer as a double, both ways: for checks in tests and
// in `cohort bench -c` (not for hot paths).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cohort/types.hpp"
#include "core/reduce.hpp"

namespace cohort::core {

inline void store_element(void* p, size_t i, DType t, double v) {
  switch (t) {
    case DType::F32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DType::F64: static_cast<double*>(p)[i] = v; break;
    case DType::F16: static_cast<uint16_t*>(p)[i] = float_to_half(static_cast<float>(v)); break;
    case DType::BF16: static_cast<uint16_t*>(p)[i] = float_to_bf16(static_cast<float>(v)); break;
    case DType::I8: static_cast<int8_t*>(p)[i] = static_cast<int8_t>(v); break;
    case DType::U8: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v); break;
    case DType::I32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    case DType::I64: static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); break;
  }
}

inline double load_element(const void* p, size_t i, DType t) {
  switch (t) {
    case DType::F32: return static_cast<const float*>(p)[i];
    case DType::F64: return static_cast<const double*>(p)[i];
    case DType::F16: return half_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::BF16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::I8: return static_cast<const int8_t*>(p)[i];
    case DType::U8: return static_cast<const uint8_t*>(p)[i];
    case DType::I32: return static_cast<const int32_t*>(p)[i];
    case DType::I64: return static_cast<const int64_t*>(p)[i];
  }
  return 0;
}

}  // namespace cohort::core
