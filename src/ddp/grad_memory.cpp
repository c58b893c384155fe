// host_grad_memory: the reducer's buckets and gradients in host memory, and
// GradMemory's defaults for what only device memories do.
#include <fmt/format.h>

#include <cstring>

#include "cohort/ddp.hpp"

namespace cohort::ddp {
namespace {

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
};

[[noreturn]] void device_only(const char* what) {
  throw Error(fmt::format("GradMemory::{} was called, but this memory does not implement it: a GradMemory whose "
                          "buckets_on_host() is false must override convert, host_to_bucket and bucket_to_host",
                          what));
}

}  // namespace

void GradMemory::grads_to_buckets(std::span<const Copy> copies) {
  for (const Copy& c : copies) grad_to_bucket(c.dst, c.src, c.bytes);
}
void GradMemory::buckets_to_grads(std::span<const Copy> copies) {
  for (const Copy& c : copies) bucket_to_grad(c.dst, c.src, c.bytes);
}

void GradMemory::convert(Buffer, Buffer, double) { device_only("convert"); }
void GradMemory::host_to_bucket(void*, const void*, size_t) { device_only("host_to_bucket"); }
void GradMemory::bucket_to_host(void*, const void*, size_t) { device_only("bucket_to_host"); }

std::shared_ptr<GradMemory> host_grad_memory() {
  static const std::shared_ptr<GradMemory> host = std::make_shared<HostGradMemory>();
  return host;
}

}  // namespace cohort::ddp
