#include "core/reduce.hpp"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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

namespace {

struct OpSum { template <class T> static T apply(T a, T b) { return a + b; } };
struct OpProd { template <class T> static T apply(T a, T b) { return a * b; } };
// Min and Max propagate a NaN from either side (as torch.minimum/maximum do),
// so that every rank ends with the same value whatever order an algorithm
// combines the ranks' data in (a plain b < a ? b : a keeps a NaN only on the left).
template <class T>
inline bool is_nan(T x) {
  return x != x;  // false for integers
}
struct OpMin { template <class T> static T apply(T a, T b) { return is_nan(a) ? a : is_nan(b) ? b : b < a ? b : a; } };
struct OpMax { template <class T> static T apply(T a, T b) { return is_nan(a) ? a : is_nan(b) ? b : a < b ? b : a; } };

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

#if defined(__x86_64__)
bool have_f16c();

// f16 with the CPU's F16C conversions, 8 elements at a time: the same results
// as loop_half<half_to_float, float_to_half> (both round to nearest even)
// except for the payload bits of a NaN. Returns how many elements it did.
template <class VOp>
__attribute__((target("avx,f16c"))) size_t loop_f16c(uint16_t* dst, const uint16_t* a, const uint16_t* b, size_t n, VOp vop) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i)));
    const __m256 y = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)));
    const __m128i r = _mm256_cvtps_ph(vop(x, y), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), r);
  }
  return i;
}

// The vector ops, as functors with the same target (so they inline into loop_f16c).
struct VSum { __attribute__((target("avx"))) __m256 operator()(__m256 x, __m256 y) const { return _mm256_add_ps(x, y); } };
struct VProd { __attribute__((target("avx"))) __m256 operator()(__m256 x, __m256 y) const { return _mm256_mul_ps(x, y); } };
// As OpMin / OpMax: min_ps(y, x) returns x when either is NaN (x's NaN kept);
// a NaN in y alone is then put back by the unordered-compare blend.
struct VMin {
  __attribute__((target("avx"))) __m256 operator()(__m256 x, __m256 y) const {
    return _mm256_blendv_ps(_mm256_min_ps(y, x), y, _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
  }
};
struct VMax {
  __attribute__((target("avx"))) __m256 operator()(__m256 x, __m256 y) const {
    return _mm256_blendv_ps(_mm256_max_ps(y, x), y, _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
  }
};

// The vector part of an f16 reduction, or 0 where the CPU has no F16C.
size_t reduce_f16_vector(uint16_t* dst, const uint16_t* a, const uint16_t* b, size_t n, ReduceOp op) {
  if (!have_f16c()) return 0;
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg: return loop_f16c(dst, a, b, n, VSum{});
    case ReduceOp::Prod: return loop_f16c(dst, a, b, n, VProd{});
    case ReduceOp::Min: return loop_f16c(dst, a, b, n, VMin{});
    case ReduceOp::Max: return loop_f16c(dst, a, b, n, VMax{});
  }
  return 0;
}
#else
size_t reduce_f16_vector(uint16_t*, const uint16_t*, const uint16_t*, size_t, ReduceOp) { return 0; }
#endif

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
    case DType::F16: {
      auto* d = static_cast<uint16_t*>(dst);
      auto* x = static_cast<const uint16_t*>(a);
      auto* y = static_cast<const uint16_t*>(b);
      const size_t done = reduce_f16_vector(d, x, y, n, op);
      dispatch_half<half_to_float, float_to_half>(d + done, x + done, y + done, n - done, op);
      return;
    }
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

namespace {

#if defined(__x86_64__)
bool have_f16c() {
  static const bool yes = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
  return yes;
}

__attribute__((target("avx,f16c"))) size_t floats_to_f16_f16c(const float* src, uint16_t* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  return i;
}

__attribute__((target("avx,f16c"))) size_t f16_to_floats_f16c(const uint16_t* src, float* dst, size_t n, float divisor) {
  const __m256 d = _mm256_set1_ps(divisor);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_div_ps(f, d));
  }
  return i;
}
#endif

}  // namespace

void floats_to_half(const float* src, uint16_t* dst, size_t n, DType half) {
  if (half == DType::BF16) {
    for (size_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
    return;
  }
  COHORT_ASSERT(half == DType::F16, "floats_to_half: half must be f16 or bf16");
  size_t i = 0;
#if defined(__x86_64__)
  if (have_f16c()) i = floats_to_f16_f16c(src, dst, n);
#endif
  for (; i < n; ++i) dst[i] = float_to_half(src[i]);
}

void half_to_floats(const uint16_t* src, float* dst, size_t n, DType half, float divisor) {
  if (half == DType::BF16) {
    for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]) / divisor;
    return;
  }
  COHORT_ASSERT(half == DType::F16, "half_to_floats: half must be f16 or bf16");
  size_t i = 0;
#if defined(__x86_64__)
  if (have_f16c()) i = f16_to_floats_f16c(src, dst, n, divisor);
#endif
  for (; i < n; ++i) dst[i] = half_to_float(src[i]) / divisor;
}

}  // namespace cohort::core
