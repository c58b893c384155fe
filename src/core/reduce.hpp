// Element-wise reduction kernels and half-precision conversions.
//
// reduce() is the inner loop of every reducing collective, so it is written to
// be auto-vectorised (-O3) and it never allocates. f16 and bf16 are reduced in
// f32 and rounded back (round to nearest even) after each pairwise step, as
// NCCL does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "cohort/types.hpp"

namespace cohort::core {

// dst[i] = a[i] (op) b[i] for i < count. dst may alias a and/or b exactly
// (not partially). Avg reduces as Sum; divide afterwards with scale_avg.
void reduce(void* dst, const void* a, const void* b, size_t count, DType dtype, ReduceOp op);

// buf[i] /= n: the last step of Avg (integer types divide with truncation).
void scale_avg(void* buf, size_t count, DType dtype, int n);

float half_to_float(uint16_t h);
uint16_t float_to_half(float f);

// bf16 is the top half of an f32: widening is a shift, narrowing rounds to
// nearest even (NaN stays a quiet NaN). Inline and branch-free so that the
// loops over arrays below and in reduce() vectorise.
inline float bf16_to_float(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (x >> 16) | 0x40u;
  return static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// Whole arrays, as the compression comm hooks need them (`half` is F16 or
// BF16): dst[i] = to_half(src[i]), and dst[i] = from_half(src[i]) / divisor.
// f16 uses the CPU's F16C conversions where it has them (the same round to
// nearest even; a NaN stays a NaN but may keep more of its payload).
void floats_to_half(const float* src, uint16_t* dst, size_t count, DType half);
void half_to_floats(const uint16_t* src, float* dst, size_t count, DType half, float divisor);

}  // namespace cohort::core
