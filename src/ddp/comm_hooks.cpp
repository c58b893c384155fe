// Built-in comm hooks: plain average, and fp16 / bf16 compression.
//
// Compression halves the bytes on the wire for f32 gradients at the cost of
// precision. The steps for a bucket of `count` elements on a group of n ranks:
//   1. compress: scratch[i] = to_half(bucket[i])          (in the hook, at launch)
//   2. allreduce(scratch, Sum) in the half type            (asynchronous)
//   3. decompress: bucket[i] = from_half(scratch[i]) / n   (the `then`, in finalize)
// Dividing after the sum (in f32) keeps small gradients from underflowing; the
// price is that the sum itself must fit the half type. A bucket already in the
// half type is reduced in place and divided by n afterwards.
#include <algorithm>
#include <cstring>
#include <string>

#include <fmt/format.h>

#include "cohort/ddp.hpp"
#include "core/input_pieces.hpp"
#include "core/reduce.hpp"

namespace cohort::ddp {
namespace {

using Half = uint16_t;
using ToHalf = Half (*)(float);
using FromHalf = float (*)(Half);

template <class T>
void compress(const T* src, Half* dst, size_t n, ToHalf to_half) {
  for (size_t i = 0; i < n; ++i) dst[i] = to_half(static_cast<float>(src[i]));
}

template <class T>
void decompress(const Half* src, T* dst, size_t n, FromHalf from_half, float divisor) {
  for (size_t i = 0; i < n; ++i) dst[i] = static_cast<T>(from_half(src[i]) / divisor);
}

// A bucket of the other half type goes through f32: bf16 <-> f16.
void compress_half(const Half* src, Half* dst, size_t n, FromHalf src_from, ToHalf to_half) {
  for (size_t i = 0; i < n; ++i) dst[i] = to_half(src_from(src[i]));
}
void decompress_half(const Half* src, Half* dst, size_t n, FromHalf from_half, ToHalf dst_to, float divisor) {
  for (size_t i = 0; i < n; ++i) dst[i] = dst_to(from_half(src[i]) / divisor);
}

std::string not_floating(const char* hook_name, size_t bucket, DType dtype) {
  return fmt::format(
      "{}: bucket {} holds {} gradients; compression applies to floating-point buckets (f32, f64, f16, bf16). "
      "HINT: use allreduce_avg_hook() for this model, or a custom hook",
      hook_name, bucket, dtype_name(dtype));
}

CommHook compress_hook(DType half, const char* hook_name) {
  const ToHalf to_half = half == DType::F16 ? core::float_to_half : core::float_to_bf16;
  const FromHalf from_half = half == DType::F16 ? core::half_to_float : core::bf16_to_float;
  return [=](GradBucket& bucket) -> CommFuture {
    const Buffer buf = bucket.buffer();
    ProcessGroup& group = bucket.group();
    const int n = group.size();
    const float divisor = static_cast<float>(n);
    const AllreduceOptions sum{.op = ReduceOp::Sum, .timeout = bucket.timeout()};

    if (!bucket.memory().buckets_on_host()) {
      // Device memory: the same steps, each queued by the bucket's memory (the GPU converts).
      GradMemory* mem = &bucket.memory();
      if (buf.dtype != DType::F32 && buf.dtype != DType::F64 && buf.dtype != DType::F16 && buf.dtype != DType::BF16)
        throw InvalidArgument(not_floating(hook_name, bucket.index(), buf.dtype));
      if (buf.dtype == half) return {group.allreduce(buf, sum), [=] { mem->convert(buf, buf, divisor); }};
      const Buffer wire{bucket.scratch(buf.count * sizeof(Half)), buf.count, half};
      mem->convert(wire, buf, 1.0);
      return {group.allreduce(wire, sum), [=] { mem->convert(buf, wire, divisor); }};
    }

    if (buf.dtype == half)  // already compressed: reduce in place
      return {group.allreduce(buf, sum), [buf, n] { core::scale_avg(buf.data, buf.count, buf.dtype, n); }};

    Half* scratch = static_cast<Half*>(bucket.scratch(buf.count * sizeof(Half)));
    const Buffer wire{scratch, buf.count, half};
    switch (buf.dtype) {
      case DType::F32: {  // the common case: whole-array conversions that vectorise
        auto* g = static_cast<float*>(buf.data);
        core::floats_to_half(g, scratch, buf.count, half);
        return {group.allreduce(wire, sum), [=] { core::half_to_floats(scratch, g, wire.count, half, divisor); }};
      }
      case DType::F64: {
        auto* g = static_cast<double*>(buf.data);
        compress(g, scratch, buf.count, to_half);
        return {group.allreduce(wire, sum), [=] { decompress(scratch, g, wire.count, from_half, divisor); }};
      }
      case DType::F16:
      case DType::BF16: {
        auto* g = static_cast<Half*>(buf.data);
        const bool f16 = buf.dtype == DType::F16;
        const FromHalf src_from = f16 ? core::half_to_float : core::bf16_to_float;
        const ToHalf dst_to = f16 ? core::float_to_half : core::float_to_bf16;
        compress_half(g, scratch, buf.count, src_from, to_half);
        return {group.allreduce(wire, sum),
                [=] { decompress_half(scratch, g, wire.count, from_half, dst_to, divisor); }};
      }
      default:
        throw InvalidArgument(not_floating(hook_name, bucket.index(), buf.dtype));
    }
  };
}

}  // namespace

Buffer GradBucket::buffer() const {
  if (pieces_ != nullptr && !pieces_->empty()) {
    core::copy_pieces(buffer_, *pieces_);
    pieces_->clear();
  }
  return buffer_;
}

WorkPtr GradBucket::allreduce(AllreduceOptions opts) const {
  std::vector<InputPiece> pieces;
  if (pieces_ != nullptr) pieces.swap(*pieces_);
  return group_.allreduce_gathered(buffer_, std::move(pieces), opts);
}

void* GradBucket::scratch(size_t bytes) {
  // Grown, never shrunk; 64-byte aligned. A device bucket's scratch is device
  // memory too; a host one is plain heap memory (the base class's allocator,
  // not the group's shared buffers).
  if (scratch_.bytes < bytes || !scratch_.data) {
    const size_t n = std::max<size_t>(bytes, 1);
    scratch_.data = memory_.buckets_on_host() ? group_.ProcessGroup::allocate_buffer(n) : memory_.allocate(group_, n);
    scratch_.bytes = bytes;
  }
  return scratch_.data.get();
}

CommHook allreduce_avg_hook() {
  return [](GradBucket& bucket) -> CommFuture {
    return {bucket.allreduce({.op = ReduceOp::Avg, .timeout = bucket.timeout()}), nullptr};
  };
}

CommHook fp16_compress_hook() { return compress_hook(DType::F16, "fp16_compress_hook"); }
CommHook bf16_compress_hook() { return compress_hook(DType::BF16, "bf16_compress_hook"); }

}  // namespace cohort::ddp
