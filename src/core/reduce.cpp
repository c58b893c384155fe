#include "core/reduce.hpp"

#include <algorithm>
#include <cstring>

#include "core/check.hpp"

namespace cohort::core {

float half_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { ++e; man <<= 1; } while ((man & 0x400u) == 0);
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / nan
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0));
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (absx < 0x38800000u) {  // result is subnormal or zero
    if (absx < 0x33000000u) return static_cast<uint16_t>(sign);
    // value = man * 2^(e - 150) with the implicit bit in man; the half subnormal
    // unit is 2^-24, so the half mantissa is man >> (126 - e), rounded to even.
    uint32_t e = absx >> 23;
    uint32_t man = (absx & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e;
    uint32_t halfman = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (halfman & 1u))) ++halfman;
    return static_cast<uint16_t>(sign | halfman);
  }
  uint32_t e = (absx >> 23) - 127 + 15;
  uint32_t man = absx & 0x7fffffu;
  uint32_t h = (e << 10) | (man >> 13);
  uint32_t rem = man & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry into the exponent: correct
  return static_cast<uint16_t>(sign | h);
}

float bf16_to_float(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet nan
  uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

namespace {

struct OpSum { template <class T> static T apply(T a, T b) { return a + b; } };
struct OpProd { template <class T> static T apply(T a, T b) { return a * b; } };
struct OpMin { template <class T> static T apply(T a, T b) { return b < a ? b : a; } };
struct OpMax { template <class T> static T apply(T a, T b) { return a < b ? b : a; } };

// Plain loops over T: GCC vectorises them at -O3 (with a runtime alias check).
template <class T, class Op>
void loop(T* dst, const T* a, const T* b, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = Op::apply(a[i], b[i]);
}

// Integer sums wrap (as in NCCL / MPI) instead of being undefined.
template <class T>
void loop_int_sum(T* dst, const T* a, const T* b, size_t n) {
  using U = std::make_unsigned_t<T>;
  for (size_t i = 0; i < n; ++i) dst[i] = static_cast<T>(static_cast<U>(a[i]) + static_cast<U>(b[i]));
}
template <class T>
void loop_int_prod(T* dst, const T* a, const T* b, size_t n) {
  using U = std::make_unsigned_t<T>;
  for (size_t i = 0; i < n; ++i) dst[i] = static_cast<T>(static_cast<U>(a[i]) * static_cast<U>(b[i]));
}

// Half types: convert a block to f32, reduce, convert back.
template <float (*ToF)(uint16_t), uint16_t (*FromF)(float), class Op>
void loop_half(uint16_t* dst, const uint16_t* a, const uint16_t* b, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = FromF(Op::apply(ToF(a[i]), ToF(b[i])));
}

template <class T>
void dispatch_typed(T* dst, const T* a, const T* b, size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:
      if constexpr (std::is_integral_v<T>) loop_int_sum(dst, a, b, n);
      else loop<T, OpSum>(dst, a, b, n);
      return;
    case ReduceOp::Prod:
      if constexpr (std::is_integral_v<T>) loop_int_prod(dst, a, b, n);
      else loop<T, OpProd>(dst, a, b, n);
      return;
    case ReduceOp::Min: loop<T, OpMin>(dst, a, b, n); return;
    case ReduceOp::Max: loop<T, OpMax>(dst, a, b, n); return;
  }
  COHORT_ASSERT(false, "reduce op out of range (validated at the API)");
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void dispatch_half(uint16_t* dst, const uint16_t* a, const uint16_t* b, size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg: loop_half<ToF, FromF, OpSum>(dst, a, b, n); return;
    case ReduceOp::Prod: loop_half<ToF, FromF, OpProd>(dst, a, b, n); return;
    case ReduceOp::Min: loop_half<ToF, FromF, OpMin>(dst, a, b, n); return;
    case ReduceOp::Max: loop_half<ToF, FromF, OpMax>(dst, a, b, n); return;
  }
  COHORT_ASSERT(false, "reduce op out of range (validated at the API)");
}

template <class T>
void scale_typed(T* p, size_t n, int div) {
  if constexpr (std::is_integral_v<T>) {
    for (size_t i = 0; i < n; ++i) p[i] = static_cast<T>(p[i] / div);
  } else {
    const T d = static_cast<T>(div);  // divide (not multiply by 1/div): exact where the quotient is representable
    for (size_t i = 0; i < n; ++i) p[i] = p[i] / d;
  }
}

}  // namespace

void reduce(void* dst, const void* a, const void* b, size_t n, DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::F32: dispatch_typed(static_cast<float*>(dst), static_cast<const float*>(a), static_cast<const float*>(b), n, op); return;
    case DType::F64: dispatch_typed(static_cast<double*>(dst), static_cast<const double*>(a), static_cast<const double*>(b), n, op); return;
    case DType::I8: dispatch_typed(static_cast<int8_t*>(dst), static_cast<const int8_t*>(a), static_cast<const int8_t*>(b), n, op); return;
    case DType::U8: dispatch_typed(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(a), static_cast<const uint8_t*>(b), n, op); return;
    case DType::I32: dispatch_typed(static_cast<int32_t*>(dst), static_cast<const int32_t*>(a), static_cast<const int32_t*>(b), n, op); return;
    case DType::I64: dispatch_typed(static_cast<int64_t*>(dst), static_cast<const int64_t*>(a), static_cast<const int64_t*>(b), n, op); return;
    case DType::F16:
      dispatch_half<half_to_float, float_to_half>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), n, op);
      return;
    case DType::BF16:
      dispatch_half<bf16_to_float, float_to_bf16>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), n, op);
      return;
  }
  COHORT_ASSERT(false, "dtype out of range (validated at the API)");
}

void scale_avg(void* buf, size_t n, DType dtype, int div) {
  switch (dtype) {
    case DType::F32: scale_typed(static_cast<float*>(buf), n, div); return;
    case DType::F64: scale_typed(static_cast<double*>(buf), n, div); return;
    case DType::I8: scale_typed(static_cast<int8_t*>(buf), n, div); return;
    case DType::U8: scale_typed(static_cast<uint8_t*>(buf), n, div); return;
    case DType::I32: scale_typed(static_cast<int32_t*>(buf), n, div); return;
    case DType::I64: scale_typed(static_cast<int64_t*>(buf), n, div); return;
    case DType::F16: {
      auto* p = static_cast<uint16_t*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] = float_to_half(half_to_float(p[i]) / static_cast<float>(div));
      return;
    }
    case DType::BF16: {
      auto* p = static_cast<uint16_t*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] = float_to_bf16(bf16_to_float(p[i]) / static_cast<float>(div));
      return;
    }
  }
  COHORT_ASSERT(false, "dtype out of range (validated at the API)");
}

}  // namespace cohort::core
