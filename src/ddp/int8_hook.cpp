// int8_compress_hook (ddp.hpp): 8-bit quantisation with error feedback, in
// two collectives per bucket so that nothing is ever summed in int8.
//
// For a bucket of `count` f32 elements on n ranks, cut into n chunks of
// k = ceil(count / n) elements (the last one padded with zeros), each sent as
// a block of a 4-byte f32 scale followed by k int8 values:
//
//   hook (at launch):    x = g + e_w;  block j = quantise(chunk j of x);  e_w = x - dequantise(block j)
//                        alltoall: block j goes to rank j
//   next (in finalize):  a = (sum over the n blocks received, dequantised) / n
//                        y = a + e_s;  block = quantise(y);  e_s = y - dequantise(block)
//                        allgather of the blocks
//   then:                bucket chunk j = dequantise(block j)
//
// quantise: scale s = max |v| / 127, q = round(v / s), so |v - q s| <= s / 2
// for every element. e_w (per element of the bucket) and e_s (per element of
// this rank's chunk) carry what rounding lost into the next step: error
// feedback, which keeps the compressed SGD converging like the plain one
// (Seide et al. 2014, "1-bit SGD"; Tang et al. 2019, "DoubleSqueeze", for the
// second error). Per rank the wire carries 2 (n-1) blocks of k + 4 bytes:
// a quarter of the ring allreduce's 2 (n-1)/n * 4 count bytes, plus the scales.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "cohort/ddp.hpp"

namespace cohort::ddp {
namespace {

struct BucketErrors {
  std::vector<float> worker;  // e_w, count elements
  std::vector<float> server;  // e_s, k elements
};

struct Int8State {
  std::map<size_t, BucketErrors> buckets;  // by bucket index
};

// Writes the block of v[0 .. len) (padded with zeros to k) at `block` and
// v - dequantised into err[0 .. len).
void quantise(const float* v, size_t len, size_t k, uint8_t* block, float* err) {
  float amax = 0.f, poison = 0.f;  // poison: v - v, NaN for an inf or NaN anywhere
  for (size_t i = 0; i < len; ++i) {
    amax = std::fabs(v[i]) > amax ? std::fabs(v[i]) : amax;
    poison += v[i] - v[i];
  }
  auto* q = reinterpret_cast<int8_t*>(block + sizeof(float));
  if (!std::isfinite(amax) || poison != 0.f) {
    // An inf or NaN (a GradScaler step that will be skipped): the scale carries
    // it, so that every dequantised element is NaN and the check after the
    // reduction sees it; the errors restart from zero instead of keeping it.
    const float bad = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(block, &bad, sizeof(float));
    std::memset(q, 0, k);
    std::fill(err, err + len, 0.f);
    return;
  }
  const float scale = amax / 127.f;
  if (scale < std::numeric_limits<float>::min()) {
    // All zero, or so small that 1 / scale overflows: send zeros, keep it all as error.
    std::memset(block, 0, sizeof(float) + k);
    std::copy(v, v + len, err);
    return;
  }
  const float inv = 1.f / scale;
  std::memcpy(block, &scale, sizeof(float));
  // Round half away from zero: |v * inv| <= 127, so the sum stays in range
  // and the loop has no call or branch (it vectorises).
  for (size_t i = 0; i < len; ++i) {
    const float t = v[i] * inv;
    const int r = static_cast<int>(t + (t >= 0.f ? 0.5f : -0.5f));
    q[i] = static_cast<int8_t>(r);
    err[i] = v[i] - static_cast<float>(r) * scale;
  }
  std::memset(q + len, 0, k - len);
}

// dst[i] (op)= dequantised block element i, for i < len.
void dequantise(const uint8_t* block, size_t len, float* dst, bool add) {
  float scale;
  std::memcpy(&scale, block, sizeof(float));
  const auto* q = reinterpret_cast<const int8_t*>(block + sizeof(float));
  if (add)
    for (size_t i = 0; i < len; ++i) dst[i] += static_cast<float>(q[i]) * scale;
  else
    for (size_t i = 0; i < len; ++i) dst[i] = static_cast<float>(q[i]) * scale;
}

// Chunk j of a bucket of `count` elements cut into chunks of k: its first element and length (the last
// chunks may be short or empty).
std::pair<size_t, size_t> chunk_of(size_t j, size_t count, size_t k) {
  const size_t first = std::min(count, j * k);
  return {first, std::min(count, first + k) - first};
}

}  // namespace

CommHook int8_compress_hook() {
  auto state = std::make_shared<Int8State>();
  return [state](GradBucket& bucket) -> CommFuture {
    const Buffer buf = bucket.buffer();
    if (!bucket.memory().buckets_on_host())
      throw InvalidArgument(fmt::format("int8_compress_hook: bucket {} is in device memory; this hook quantises on "
                                        "the host. HINT: use fp16_compress_hook() or bf16_compress_hook() on GPUs",
                                        bucket.index()));
    if (buf.dtype != DType::F32)
      throw InvalidArgument(fmt::format("int8_compress_hook: bucket {} holds {} gradients; it quantises f32 buckets. "
                                        "HINT: use allreduce_avg_hook() or bf16_compress_hook() for this model",
                                        bucket.index(), dtype_name(buf.dtype)));
    ProcessGroup& group = bucket.group();
    const int n = group.size(), me = group.rank();
    const size_t count = buf.count, k = (count + n - 1) / n, block = sizeof(float) + k;
    const Millis timeout = bucket.timeout();
    BucketErrors* err = &state->buckets[bucket.index()];  // map nodes stay put
    if (err->worker.size() != count || err->server.size() != k)
      *err = {std::vector<float>(count), std::vector<float>(k)};

    // Scratch: the alltoall's input and output, the allgather's output.
    auto* send = static_cast<uint8_t*>(bucket.scratch(3 * n * block));
    uint8_t* recv = send + n * block;
    uint8_t* gathered = recv + n * block;
    auto* g = static_cast<float*>(buf.data);
    std::vector<float> x(k);
    for (int j = 0; j < n; ++j) {
      const auto [first, len] = chunk_of(size_t(j), count, k);
      for (size_t i = 0; i < len; ++i) x[i] = g[first + i] + err->worker[first + i];
      quantise(x.data(), len, k, send + j * block, err->worker.data() + first);
    }
    const Buffer wire_out{send, n * block, DType::U8}, wire_in{recv, n * block, DType::U8};
    WorkPtr exchange = group.alltoall(wire_out, wire_in, {.timeout = timeout});

    // state keeps *err alive while this step is pending.
    auto reduce_and_gather = [state, err, recv, gathered, g, count, k, block, n, me, timeout, &group]() -> CommFuture {
      const size_t len = chunk_of(size_t(me), count, k).second;
      std::vector<float> avg(k, 0.f);
      for (int j = 0; j < n; ++j) dequantise(recv + j * block, len, avg.data(), true);
      for (size_t i = 0; i < len; ++i) avg[i] = avg[i] / static_cast<float>(n) + err->server[i];
      uint8_t* mine = gathered + me * block;
      quantise(avg.data(), len, k, mine, err->server.data());
      WorkPtr gather = group.allgather(Buffer{mine, block, DType::U8}, Buffer{gathered, n * block, DType::U8},
                                       {.timeout = timeout});
      auto unpack = [=] {
        for (int j = 0; j < n; ++j) {
          const auto [f, l] = chunk_of(size_t(j), count, k);
          dequantise(gathered + j * block, l, g + f, false);
        }
      };
      return {gather, unpack, nullptr};
    };
    return {exchange, nullptr, reduce_and_gather};
  };
}

}  // namespace cohort::ddp
