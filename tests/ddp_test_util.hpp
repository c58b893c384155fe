// Helpers of the reducer tests: a mixed-dtype model, per-rank gradient
// storage, and closed-form gradient values (small integers, exact in f16, bf16,
// f32 and f64, and so are their averages over 1..4 ranks).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cohort/ddp.hpp"
#include "core/reduce.hpp"
#include "test_util.hpp"

namespace cohort::ddp::test {

inline void put_value(void* p, size_t i, DType t, double v) {
  switch (t) {
    case DType::F32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DType::F64: static_cast<double*>(p)[i] = v; break;
    case DType::F16: static_cast<uint16_t*>(p)[i] = core::float_to_half(static_cast<float>(v)); break;
    case DType::BF16: static_cast<uint16_t*>(p)[i] = core::float_to_bf16(static_cast<float>(v)); break;
    case DType::I32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    default: ADD_FAILURE() << "put_value: dtype " << dtype_name(t) << " not handled";
  }
}

inline double get_value(const void* p, size_t i, DType t) {
  switch (t) {
    case DType::F32: return static_cast<const float*>(p)[i];
    case DType::F64: return static_cast<const double*>(p)[i];
    case DType::F16: return core::half_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::BF16: return core::bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::I32: return static_cast<const int32_t*>(p)[i];
    default: ADD_FAILURE() << "get_value: dtype " << dtype_name(t) << " not handled";
  }
  return 0;
}

// Every dtype a gradient bucket may have, a zero-size parameter, and one
// parameter (80 KB) above COHORT_INLINE_BYTES so that its bucket goes through
// the group's progress thread. With small_buckets() it plans 6 buckets:
// [9 8] [7] [6] [5] [4 3 2] [1 0] (see BucketPlan.MixedModel).
inline std::vector<ParamSpec> mixed_model() {
  return {{"embed", 300, DType::F32}, {"l1.w", 100, DType::F32},   {"l1.b", 0, DType::F32},
          {"l2.w", 50, DType::F64},   {"l2.b", 7, DType::F64},     {"l3.w", 40, DType::BF16},
          {"l3.b", 3, DType::F16},    {"big", 20000, DType::F32},  {"head.w", 120, DType::F32},
          {"head.b", 1, DType::F32}};
}
inline constexpr size_t kMixedBuckets = 6;

// Caps of 2000 bytes (600 for the first bucket).
inline ReducerOptions small_buckets() {
  ReducerOptions o;
  o.bucket_cap_mb = 2000.0 / (1 << 20);
  o.first_bucket_mb = 600.0 / (1 << 20);
  return o;
}

// Gradient of rank r for parameter p, element i, in iteration t.
inline double grad_value(int r, size_t p, size_t i, int t) { return (r + 1) * double(1 + (p + i + t) % 4); }
// Its average over n ranks, and its sum.
inline double avg_value(int n, size_t p, size_t i, int t) { return (n + 1) / 2.0 * double(1 + (p + i + t) % 4); }
inline double sum_value(int n, size_t p, size_t i, int t) { return n * (n + 1) / 2.0 * double(1 + (p + i + t) % 4); }

// One rank's gradient storage; specs[p].grad points into it.
struct Grads {
  std::vector<ParamSpec> specs;
  std::vector<std::vector<uint64_t>> mem;

  explicit Grads(std::vector<ParamSpec> s) : specs(std::move(s)), mem(specs.size()) {
    for (size_t p = 0; p < specs.size(); ++p) {
      mem[p].assign((specs[p].count * dtype_size(specs[p].dtype) + 7) / 8 + 1, 0);
      specs[p].grad = mem[p].data();
    }
  }
  void* ptr(size_t p) { return mem[p].data(); }
  double at(size_t p, size_t i) const { return get_value(mem[p].data(), i, specs[p].dtype); }
  void put(size_t p, size_t i, double v) { put_value(mem[p].data(), i, specs[p].dtype, v); }
  template <class F> void fill(F value) {
    for (size_t p = 0; p < specs.size(); ++p)
      for (size_t i = 0; i < specs[p].count; ++i) put(p, i, value(p, i));
  }
};

// Compares every element of every parameter read by `got(p, i)` with
// `want(p, i)`; reports the first few mismatches with the rank.
template <class Got, class Want>
void expect_values(const std::vector<ParamSpec>& specs, int rank, const std::string& what, Got got, Want want) {
  int wrong = 0;
  for (size_t p = 0; p < specs.size() && wrong < 5; ++p)
    for (size_t i = 0; i < specs[p].count && wrong < 5; ++i) {
      double g = got(p, i), w = want(p, i);
      if (g != w) {
        ++wrong;
        ADD_FAILURE() << what << ": rank " << rank << " parameter " << specs[p].name << " element " << i << ": got "
                      << g << ", expected " << w;
      }
    }
}

inline std::vector<size_t> shuffled(size_t n, unsigned seed) {
  std::vector<size_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = i;
  std::mt19937 rng(seed);
  std::shuffle(v.begin(), v.end(), rng);
  return v;
}

// Transport x world size.
struct Config {
  std::string transport;
  int world;
};
inline void PrintTo(const Config& c, std::ostream* os) { *os << c.transport << " x " << c.world << " ranks"; }
inline std::vector<Config> configs() {
  std::vector<Config> v;
  for (const char* t : {"shm", "tcp"})
    for (int n = 1; n <= 4; ++n) v.push_back({t, n});
  return v;
}
inline std::string config_name(const ::testing::TestParamInfo<Config>& i) {
  return i.param.transport + "_np" + std::to_string(i.param.world);
}

// Runs `body` and returns the cohort::Error message it threw ("" if none).
template <class F>
std::string error_of(F body) {
  try {
    body();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace cohort::ddp::test
