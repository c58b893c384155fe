// host_grad_memory: the reducer's buckets and gradients in host memory.
#include <fmt/format.h>

#include <cstring>
#include <vector>

#include "cohort/ddp.hpp"
#include "core/reduce.hpp"

namespace cohort::ddp {
namespace {

double load(const void* p, size_t i, DType t) {
  switch (t) {
    case DType::F32: return static_cast<const float*>(p)[i];
    case DType::F64: return static_cast<const double*>(p)[i];
    case DType::F16: return core::half_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::BF16: return core::bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: break;
  }
  throw InvalidArgument(fmt::format("GradMemory::convert: {} is not a floating-point type", dtype_name(t)));
}

void store(void* p, size_t i, DType t, double v) {
  switch (t) {
    case DType::F32: static_cast<float*>(p)[i] = static_cast<float>(v); return;
    case DType::F64: static_cast<double*>(p)[i] = v; return;
    case DType::F16: static_cast<uint16_t*>(p)[i] = core::float_to_half(static_cast<float>(v)); return;
    case DType::BF16: static_cast<uint16_t*>(p)[i] = core::float_to_bf16(static_cast<float>(v)); return;
    default: break;
  }
  throw InvalidArgument(fmt::format("GradMemory::convert: {} is not a floating-point type", dtype_name(t)));
}

class HostGradMemory final : public GradMemory {
 public:
  bool buckets_on_host() const override { return true; }
  bool grads_on_host() const override { return true; }
  std::shared_ptr<std::byte[]> allocate(ProcessGroup& group, size_t bytes) override {
    return group.allocate_buffer(bytes);
  }
  void grad_to_bucket(void* bucket, const void* grad, size_t bytes) override { std::memcpy(bucket, grad, bytes); }
  void bucket_to_grad(void* grad, const void* bucket, size_t bytes) override { std::memcpy(grad, bucket, bytes); }
  void zero_bucket(void* bucket, size_t bytes) override { std::memset(bucket, 0, bytes); }
  void convert(Buffer dst, Buffer src, double divisor) override {
    if (dst.count != src.count)
      throw InvalidArgument(fmt::format("GradMemory::convert: {} elements into {}", src.count, dst.count));
    // Element by element, each read before it is written: dst may be src.
    for (size_t i = 0; i < src.count; ++i) store(dst.data, i, dst.dtype, load(src.data, i, src.dtype) / divisor);
  }
  void host_to_bucket(void* bucket, const void* host, size_t bytes) override { std::memcpy(bucket, host, bytes); }
  void bucket_to_host(void* host, const void* bucket, size_t bytes) override { std::memcpy(host, bucket, bytes); }
};

}  // namespace

std::shared_ptr<GradMemory> host_grad_memory() {
  static const std::shared_ptr<GradMemory> host = std::make_shared<HostGradMemory>();
  return host;
}

}  // namespace cohort::ddp
