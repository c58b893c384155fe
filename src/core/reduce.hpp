// Element-wise reduction kernels and half-precision conversions.
//
// reduce() is the inner loop of every reducing collective, so it is written to
// be auto-vectorised (-O3) and it never allocates. f16 and bf16 are reduced in
// f32 and rounded back (round to nearest even) after each pairwise step, as
// NCCL does.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cohort/types.hpp"

namespace cohort::core {

// dst[i] = a[i] (op) b[i] for i < count. dst may alias a and/or b exactly
// (not partially). Avg reduces as Sum; divide afterwards with scale_avg.
void reduce(void* dst, const void* a, const void* b, size_t count, DType dtype, ReduceOp op);

// buf[i] /= n: the last step of Avg (integer types divide with truncation).
void scale_avg(void* buf, size_t count, DType dtype, int n);

float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bf16_to_float(uint16_t b);
uint16_t float_to_bf16(float f);

}  // namespace cohort::core
