// powersgd_hook (ddp.hpp): PowerSGD with error feedback and warm start, the
// algorithm of PyTorch's powerSGD_hook (so that one step of each, given the
// same gradients and the same Q, agrees: tests/ddp_powersgd_test.cpp).
//
// Per bucket of f32 gradients g on n ranks, once iteration >= start_iter:
//   x = g + e                                   (error feedback; e = 0 at first)
//   each gradient k viewed as M_k (rows_k x m_k) is compressed when
//     (rows_k + m_k) r min_compression_rate < rows_k m_k, r = min(rank, rows_k, m_k);
//   the others are concatenated and averaged as they are:
//   1. allreduce(uncompressed), / n, back into x;         Q_k orthogonalised (random at first, else last Q)
//      P_k = M_k Q_k
//   2. allreduce(P), sum; P_k orthogonalised; Q_k = M_k^T P_k
//   3. allreduce(Q), / n; M_k = P_k Q_k^T into the bucket; e = x_before - bucket
// Only P and Q cross the wire for compressed matrices: (rows + m) r elements
// instead of rows m. Orthogonalisation is Gram-Schmidt with
// reorthogonalisation (PyTorch takes QR for rank > 2, which gives the same
// columns up to sign; P Q^T does not see the signs). Products accumulate in
// double.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "cohort/ddp.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace cohort::ddp {
namespace {

struct Matrix {
  size_t offset, rows, cols, rank, p_at, q_at;
};

// Orthonormalises the columns of a (rows x cols, row-major), in double:
// Gram-Schmidt with each column's projections removed twice ("twice is
// enough", Giraud et al. 2005), then normalised (by norm + eps). PyTorch
// runs one pass of Gram-Schmidt for rank <= 2 and QR above; a single pass
// in float loses orthogonality when a column is nearly dependent on the
// others (a gradient of lower rank than r), and P P^T M then differs from M.
// An all-zero column stays zero.
void orthogonalise(float* a, size_t rows, size_t cols, float eps) {
  std::vector<double> d(a, a + rows * cols);
  for (size_t i = 0; i < cols; ++i) {
    for (int pass = 0; pass < 2; ++pass)
      for (size_t j = 0; j < i; ++j) {
        double dot = 0;
        for (size_t r = 0; r < rows; ++r) dot += d[r * cols + j] * d[r * cols + i];
        for (size_t r = 0; r < rows; ++r) d[r * cols + i] -= dot * d[r * cols + j];
      }
    double norm = 0;
    for (size_t r = 0; r < rows; ++r) norm += d[r * cols + i] * d[r * cols + i];
    norm = std::sqrt(norm);
    const double div = eps == 0 ? norm : norm + eps;
    for (size_t r = 0; r < rows; ++r) d[r * cols + i] = div > 0 ? d[r * cols + i] / div : 0.0;
  }
  for (size_t x = 0; x < rows * cols; ++x) a[x] = static_cast<float>(d[x]);
}

// The three products, over every compressed gradient each iteration: r
// multiply-adds per gradient element each, the hook's whole arithmetic
// (about 40 M per product for the example's 10 M-parameter MLP at rank 4).
// Products accumulate in double; the portable loops are below, the x86-64
// ones (AVX2 + FMA, picked at run time) take 4 doubles of the rank at a
// time and are 3-5x faster on the VM (2048 x 2048, rank 4: 9.0 -> 2.5 ms
// for P, 6.6 -> 1.6 for Q, 8.4 -> 2.6 for M). Both round the double sums to
// the same floats up to the order of the additions.

// p (n x r) = m (n x c) q (c x r)
void mul_portable(const float* m, const float* q, float* p, size_t n, size_t c, size_t r) {
  std::vector<double> acc(r);
  for (size_t i = 0; i < n; ++i) {
    std::fill(acc.begin(), acc.end(), 0.0);
    const float* row = m + i * c;
    for (size_t j = 0; j < c; ++j)
      for (size_t k = 0; k < r; ++k) acc[k] += double(row[j]) * q[j * r + k];
    for (size_t k = 0; k < r; ++k) p[i * r + k] = float(acc[k]);
  }
}

// q (c x r) = m^T (c x n) p (n x r)
void mul_transposed_portable(const float* m, const float* p, float* q, size_t n, size_t c, size_t r) {
  std::vector<double> acc(c * r, 0.0);
  for (size_t i = 0; i < n; ++i) {
    const float* row = m + i * c;
    for (size_t j = 0; j < c; ++j)
      for (size_t k = 0; k < r; ++k) acc[j * r + k] += double(row[j]) * p[i * r + k];
  }
  for (size_t x = 0; x < c * r; ++x) q[x] = float(acc[x]);
}

// m (n x c) = p (n x r) q^T (r x c)
void mul_outer_portable(const float* p, const float* q, float* m, size_t n, size_t c, size_t r) {
  for (size_t i = 0; i < n; ++i)
    for (size_t j = 0; j < c; ++j) {
      double s = 0;
      for (size_t k = 0; k < r; ++k) s += double(p[i * r + k]) * q[j * r + k];
      m[i * c + j] = float(s);
    }
}

#if defined(__x86_64__)
bool have_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

// A c x r float matrix as doubles, each row padded with zeros to `stride` (a multiple of 4).
std::vector<double> padded_rows(const float* a, size_t c, size_t r, size_t stride) {
  std::vector<double> out(c * stride, 0.0);
  for (size_t j = 0; j < c; ++j)
    for (size_t k = 0; k < r; ++k) out[j * stride + k] = a[j * r + k];
  return out;
}

// P: for each row of m and each 4 columns of Q, four accumulators (one per
// j mod 4, so that the additions do not wait on each other).
__attribute__((target("avx2,fma"))) void mul_avx2(const float* m, const float* q, float* p, size_t n, size_t c,
                                                  size_t r) {
  const size_t stride = (r + 3) / 4 * 4;
  const std::vector<double> qd = padded_rows(q, c, r, stride);
  alignas(32) double out[4];
  for (size_t i = 0; i < n; ++i) {
    const float* row = m + i * c;
    for (size_t v = 0; v < stride; v += 4) {
      const double* qv = qd.data() + v;
      __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
      size_t j = 0;
      for (; j + 4 <= c; j += 4) {
        a0 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_broadcast_ss(row + j)), _mm256_loadu_pd(qv + j * stride), a0);
        a1 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_broadcast_ss(row + j + 1)), _mm256_loadu_pd(qv + (j + 1) * stride), a1);
        a2 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_broadcast_ss(row + j + 2)), _mm256_loadu_pd(qv + (j + 2) * stride), a2);
        a3 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_broadcast_ss(row + j + 3)), _mm256_loadu_pd(qv + (j + 3) * stride), a3);
      }
      for (; j < c; ++j)
        a0 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_broadcast_ss(row + j)), _mm256_loadu_pd(qv + j * stride), a0);
      _mm256_store_pd(out, _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3)));
      for (size_t k = v; k < std::min(r, v + 4); ++k) p[i * r + k] = float(out[k - v]);
    }
  }
}

// Q: four rows of m at a time into each row of the accumulator (one load and
// store of it for four multiply-adds).
__attribute__((target("avx2,fma"))) void mul_transposed_avx2(const float* m, const float* p, float* q, size_t n,
                                                             size_t c, size_t r) {
  const size_t stride = (r + 3) / 4 * 4;
  const std::vector<double> pd = padded_rows(p, n, r, stride);
  std::vector<double> acc(c * stride, 0.0);
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const float *m0 = m + i * c, *m1 = m0 + c, *m2 = m1 + c, *m3 = m2 + c;
    for (size_t v = 0; v < stride; v += 4) {
      const double* pv = pd.data() + i * stride + v;
      const __m256d p0 = _mm256_loadu_pd(pv), p1 = _mm256_loadu_pd(pv + stride);
      const __m256d p2 = _mm256_loadu_pd(pv + 2 * stride), p3 = _mm256_loadu_pd(pv + 3 * stride);
      double* a = acc.data() + v;
      for (size_t j = 0; j < c; ++j) {
        __m256d s = _mm256_loadu_pd(a + j * stride);
        s = _mm256_fmadd_pd(_mm256_set1_pd(m0[j]), p0, s);
        s = _mm256_fmadd_pd(_mm256_set1_pd(m1[j]), p1, s);
        s = _mm256_fmadd_pd(_mm256_set1_pd(m2[j]), p2, s);
        s = _mm256_fmadd_pd(_mm256_set1_pd(m3[j]), p3, s);
        _mm256_storeu_pd(a + j * stride, s);
      }
    }
  }
  for (; i < n; ++i)
    for (size_t v = 0; v < stride; v += 4) {
      const __m256d p0 = _mm256_loadu_pd(pd.data() + i * stride + v);
      double* a = acc.data() + v;
      for (size_t j = 0; j < c; ++j)
        _mm256_storeu_pd(a + j * stride, _mm256_fmadd_pd(_mm256_set1_pd(m[i * c + j]), p0, _mm256_loadu_pd(a + j * stride)));
    }
  for (size_t j = 0; j < c; ++j)
    for (size_t k = 0; k < r; ++k) q[j * r + k] = float(acc[j * stride + k]);
}

// M: four columns of a row at a time, from Q transposed (r rows of c doubles).
__attribute__((target("avx2,fma"))) void mul_outer_avx2(const float* p, const float* q, float* m, size_t n, size_t c,
                                                        size_t r) {
  std::vector<double> qt(r * c);
  for (size_t j = 0; j < c; ++j)
    for (size_t k = 0; k < r; ++k) qt[k * c + j] = q[j * r + k];
  for (size_t i = 0; i < n; ++i) {
    const float* pi = p + i * r;
    float* out = m + i * c;
    size_t j = 0;
    for (; j + 4 <= c; j += 4) {
      __m256d s = _mm256_setzero_pd();
      for (size_t k = 0; k < r; ++k) s = _mm256_fmadd_pd(_mm256_set1_pd(pi[k]), _mm256_loadu_pd(qt.data() + k * c + j), s);
      _mm_storeu_ps(out + j, _mm256_cvtpd_ps(s));
    }
    for (; j < c; ++j) {
      double s = 0;
      for (size_t k = 0; k < r; ++k) s = std::fma(double(pi[k]), qt[k * c + j], s);
      out[j] = float(s);
    }
  }
}
#endif

void mul(const float* m, const float* q, float* p, size_t n, size_t c, size_t r) {
#if defined(__x86_64__)
  if (have_avx2_fma()) return mul_avx2(m, q, p, n, c, r);
#endif
  mul_portable(m, q, p, n, c, r);
}

void mul_transposed(const float* m, const float* p, float* q, size_t n, size_t c, size_t r) {
#if defined(__x86_64__)
  if (have_avx2_fma()) return mul_transposed_avx2(m, p, q, n, c, r);
#endif
  mul_transposed_portable(m, p, q, n, c, r);
}

void mul_outer(const float* p, const float* q, float* m, size_t n, size_t c, size_t r) {
#if defined(__x86_64__)
  if (have_avx2_fma()) return mul_outer_avx2(p, q, m, n, c, r);
#endif
  mul_outer_portable(p, q, m, n, c, r);
}

// The bucket's matrices to compress, grouped by shape in order of first
// appearance (PyTorch's P and Q layout), and the offsets/counts of the rest.
struct Split {
  std::vector<Matrix> compress;
  std::vector<std::pair<size_t, size_t>> plain;  // (offset, count), bucket order
  size_t p_total = 0, q_total = 0, plain_total = 0;
};

Split split(const GradBucket& b, const PowerSgdOptions& o) {
  Split s;
  std::vector<Matrix> found;
  const auto offsets = b.offsets(), counts = b.counts(), rows = b.rows();
  for (size_t k = 0; k < offsets.size(); ++k) {
    const size_t count = counts[k];
    const size_t n = rows[k] > 0 ? rows[k] : count;
    const size_t m = n > 0 ? count / n : 0;
    const size_t r = std::min({static_cast<size_t>(o.rank), n, m});
    // A matrix only when rows divides the count (else it is averaged as it is).
    if (count > 0 && n * m == count && double((n + m) * r) * o.min_compression_rate < double(n * m))
      found.push_back({offsets[k], n, m, r, 0, 0});
    else
      s.plain.emplace_back(offsets[k], count);
  }
  std::vector<std::pair<size_t, size_t>> shapes;  // first appearance order
  for (const auto& f : found)
    if (std::find(shapes.begin(), shapes.end(), std::pair{f.rows, f.cols}) == shapes.end())
      shapes.emplace_back(f.rows, f.cols);
  for (const auto& shape : shapes)
    for (auto f : found)
      if (std::pair{f.rows, f.cols} == shape) {
        f.p_at = s.p_total;
        f.q_at = s.q_total;
        s.p_total += f.rows * f.rank;
        s.q_total += f.cols * f.rank;
        s.compress.push_back(f);
      }
  for (const auto& [off, count] : s.plain) s.plain_total += count;
  return s;
}

}  // namespace

PowerSgdState::PowerSgdState(PowerSgdOptions opts) : opts_(opts) {
  if (opts_.rank < 1)
    throw InvalidArgument(fmt::format("PowerSgdOptions::rank {}: the approximation rank must be at least 1", opts_.rank));
  if (opts_.start_iter < 0) throw InvalidArgument("PowerSgdOptions::start_iter must not be negative");
  if ((opts_.error_feedback || opts_.warm_start) && opts_.start_iter < 2)
    throw InvalidArgument(fmt::format(
        "PowerSgdOptions::start_iter {}: with error feedback or warm start, run at least 2 plain iterations first "
        "(as PyTorch requires: DDP may rebuild its buckets after the first one)",
        opts_.start_iter));
}

std::vector<NamedTensor> PowerSgdState::state() const {
  std::vector<NamedTensor> out{make_tensor("powersgd.iteration", {1}, std::vector<int64_t>{iter_})};
  for (const auto& [b, k] : buckets_) {
    if (!k.q.empty()) out.push_back(make_tensor(fmt::format("powersgd.bucket{}.q", b), {int64_t(k.q.size())}, k.q));
    if (!k.error.empty())
      out.push_back(make_tensor(fmt::format("powersgd.bucket{}.error", b), {int64_t(k.error.size())}, k.error));
  }
  return out;
}

void PowerSgdState::load_state(const std::vector<NamedTensor>& tensors, bool with_error) {
  constexpr const char* kWho = "PowerSgdState::load_state";
  std::optional<int64_t> iter;
  std::map<size_t, Bucket> fresh;
  for (const NamedTensor& t : tensors) {
    if (t.name.rfind("powersgd.", 0) != 0) continue;  // other state in the same file
    if (t.name == "powersgd.iteration") {
      if (t.dtype != DType::I64 || t.numel() != 1 || t.bytes.size() != sizeof(int64_t))
        throw InvalidArgument(fmt::format("{}: \"{}\" must be one int64", kWho, t.name));
      int64_t v = 0;
      std::memcpy(&v, t.bytes.data(), sizeof(v));
      if (v < 0) throw InvalidArgument(fmt::format("{}: \"{}\" is {}, a negative iteration", kWho, t.name, v));
      iter = v;
      continue;
    }
    // "powersgd.bucket<digits>.<q|error>", nothing else.
    constexpr std::string_view kBucket = "powersgd.bucket";
    const std::string_view name(t.name);
    const auto not_state = [&] {
      return InvalidArgument(fmt::format("{}: \"{}\" is not PowerSGD state (powersgd.iteration, "
                                         "powersgd.bucket<b>.q, powersgd.bucket<b>.error)",
                                         kWho, t.name));
    };
    if (name.rfind(kBucket, 0) != 0) throw not_state();
    const size_t dot = name.find('.', kBucket.size());
    const std::string_view digits = name.substr(kBucket.size(), dot == std::string_view::npos ? 0 : dot - kBucket.size());
    const std::string_view field = dot == std::string_view::npos ? std::string_view{} : name.substr(dot + 1);
    size_t b = 0;
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), b);
    if (digits.empty() || ec != std::errc{} || end != digits.data() + digits.size() ||
        (digits.size() > 1 && digits.front() == '0') || (field != "q" && field != "error"))
      throw not_state();
    std::vector<float>& slot = field == "q" ? fresh[b].q : fresh[b].error;
    if (!slot.empty()) throw InvalidArgument(fmt::format("{}: \"{}\" appears twice", kWho, t.name));
    if (t.dtype != DType::F32 || t.bytes.size() != t.numel() * sizeof(float))
      throw InvalidArgument(fmt::format("{}: \"{}\" is not an f32 tensor of its shape ({}, {} bytes)", kWho, t.name,
                                        dtype_name(t.dtype), t.bytes.size()));
    if (field == "error" && !with_error) continue;
    slot.resize(t.numel());
    if (!slot.empty()) std::memcpy(slot.data(), t.bytes.data(), slot.size() * sizeof(float));
  }
  for (auto it = fresh.begin(); it != fresh.end();)  // a bucket of empty tensors holds nothing
    it = it->second.q.empty() && it->second.error.empty() ? fresh.erase(it) : std::next(it);
  if (!iter)
    throw InvalidArgument(fmt::format("{}: no \"powersgd.iteration\" among {} tensors: not PowerSgdState::state()", kWho,
                                      tensors.size()));
  iter_ = *iter;
  buckets_ = std::move(fresh);
}

CommHook powersgd_hook(std::shared_ptr<PowerSgdState> state) {
  if (!state) throw InvalidArgument("powersgd_hook: the state is null; pass std::make_shared<PowerSgdState>(options)");
  return [state](GradBucket& bucket) -> CommFuture {
    const Buffer buf = bucket.buffer();
    const size_t index = bucket.index();
    const bool last = bucket.is_last();
    if (!bucket.memory().buckets_on_host() || buf.dtype != DType::F32)
      throw InvalidArgument(fmt::format("powersgd_hook: bucket {} holds {} gradients{}; it compresses f32 buckets in "
                                        "host memory. HINT: use allreduce_avg_hook() or bf16_compress_hook()",
                                        index, dtype_name(buf.dtype),
                                        bucket.memory().buckets_on_host() ? "" : " in device memory"));
    const size_t np = bucket.params().size();
    if (bucket.offsets().size() != np || bucket.counts().size() != np || bucket.rows().size() != np)
      throw InvalidArgument(fmt::format("powersgd_hook: bucket {} came without its parameters' offsets, counts and "
                                        "rows (GradBucket's offsets/counts/rows); a Reducer passes them",
                                        index));
    ProcessGroup& group = bucket.group();
    const Millis timeout = bucket.timeout();
    const PowerSgdOptions& o = state->options();
    if (state->iteration() < o.start_iter) {
      if (last) state->next_iteration();
      return {bucket.allreduce({.op = ReduceOp::Avg, .timeout = timeout}), nullptr, nullptr};
    }
    const int n = group.size();
    auto* x = static_cast<float*>(buf.data);
    const size_t count = buf.count;
    PowerSgdState::Bucket* st = &state->bucket(index);
    auto sp = std::make_shared<Split>(split(bucket, o));
    if (o.error_feedback) {
      // x = g + e; next_error keeps x (x_before) until finish() subtracts the
      // approximation and swaps it in. No allocation per iteration, and an
      // iteration that fails leaves the last completed error in place.
      if (st->error.size() != count) st->error.assign(count, 0.f);
      st->next_error.resize(count);
      const float* e = st->error.data();
      float* before = st->next_error.data();
      for (size_t i = 0; i < count; ++i) before[i] = x[i] += e[i];
    }
    // Ps and Qs, random Qs the first time (or always without warm start).
    const bool random_q = !o.warm_start || st->q.size() != sp->q_total;
    st->p.assign(sp->p_total, 0.f);
    if (random_q) {
      st->q.resize(sp->q_total);
      // The same on every rank; a new Q each iteration without warm start (as PyTorch draws a new seed).
      std::mt19937_64 rng(o.seed + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(index + 1) +
                          0xBF58476D1CE4E5B9ull * static_cast<uint64_t>(state->iteration()));
      std::normal_distribution<float> normal;
      for (float& v : st->q) v = normal(rng);
    }
    for (const Matrix& mx : sp->compress) {
      orthogonalise(st->q.data() + mx.q_at, mx.cols, mx.rank, o.orthogonalization_epsilon);
      mul(x + mx.offset, st->q.data() + mx.q_at, st->p.data() + mx.p_at, mx.rows, mx.cols, mx.rank);
    }
    auto plain = std::make_shared<std::vector<float>>();
    plain->reserve(sp->plain_total);
    for (const auto& [off, c] : sp->plain) plain->insert(plain->end(), x + off, x + off + c);
    const AllreduceOptions sum{.op = ReduceOp::Sum, .timeout = timeout};
    WorkPtr w1 = group.allreduce(Buffer{plain->data(), plain->size(), DType::F32}, sum);

    auto finish = [=]() {
      for (float& v : st->q) v /= static_cast<float>(n);
      for (const Matrix& mx : sp->compress)
        mul_outer(st->p.data() + mx.p_at, st->q.data() + mx.q_at, x + mx.offset, mx.rows, mx.cols, mx.rank);
      if (o.error_feedback) {
        for (size_t i = 0; i < count; ++i) st->next_error[i] -= x[i];
        st->error.swap(st->next_error);
      }
      if (!o.warm_start) st->q.clear();
      if (last) state->next_iteration();
    };
    auto compute_qs = [=, &group]() -> CommFuture {
      for (const Matrix& mx : sp->compress) {
        orthogonalise(st->p.data() + mx.p_at, mx.rows, mx.rank, o.orthogonalization_epsilon);
        mul_transposed(x + mx.offset, st->p.data() + mx.p_at, st->q.data() + mx.q_at, mx.rows, mx.cols, mx.rank);
      }
      return {group.allreduce(Buffer{st->q.data(), st->q.size(), DType::F32}, sum), finish, nullptr};
    };
    auto unpack_and_send_ps = [=, &group]() -> CommFuture {
      size_t at = 0;
      for (const auto& [off, c] : sp->plain) {
        for (size_t i = 0; i < c; ++i) x[off + i] = (*plain)[at + i] / static_cast<float>(n);
        at += c;
      }
      return {group.allreduce(Buffer{st->p.data(), st->p.size(), DType::F32}, sum), nullptr, compute_qs};
    };
    return {w1, nullptr, unpack_and_send_ps};
  };
}

}  // namespace cohort::ddp
