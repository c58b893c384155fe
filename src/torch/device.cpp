// Device placement of DistributedDataParallel: the checks, the reducer's
// memory for a CUDA module, and small collectives on any group (device.hpp).
#include "device.hpp"

#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>
#include <torch/version.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <sstream>

namespace cohort::torch {
namespace {

// c10::Stream::native_handle() (the cudaStream_t) exists from LibTorch 2.1 on.
template <class S>
concept HasNativeHandle = requires(const S& s) { s.native_handle(); };

template <class S>
void* native_handle(const S& s) {
  if constexpr (HasNativeHandle<S>)
    return s.native_handle();
  else
    return nullptr;  // memory_mode() refuses CUDA modules on such a LibTorch
}

std::string device_text(const ::torch::Device& d) {
  std::ostringstream s;
  s << d;
  return s.str();
}

::torch::TensorOptions bytes_on(const ::torch::Device& d) {
  return ::torch::TensorOptions().dtype(::torch::kUInt8).device(d);
}

// A tensor over memory the reducer owns (no copy, no ownership).
::torch::Tensor view(void* p, size_t count, DType t, const ::torch::Device& d) {
  return wrap(p, {static_cast<int64_t>(count)}, ::torch::TensorOptions().dtype(to_scalar_type(t)).device(d));
}
::torch::Tensor bytes(const void* p, size_t n, const ::torch::Device& d) {
  return wrap(const_cast<void*>(p), {static_cast<int64_t>(n)}, bytes_on(d));
}

// at::_foreach_copy_ (LibTorch 2.1 on; found by argument-dependent lookup,
// so that 1.13, which lacks it and never runs device mode, still compiles).
template <class List>
concept HasForeachCopy = requires(List l) { _foreach_copy_(l, l, false); };

#if defined(TORCH_VERSION_MAJOR) && (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1))
static_assert(HasForeachCopy<at::TensorList>, "LibTorch 2.1+ has at::_foreach_copy_: the batched copies need it");
#endif

template <class List>
void foreach_copy(List dst, List src) {
  if constexpr (HasForeachCopy<List>) {
    _foreach_copy_(dst, src, false);
  } else {
    for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(src[i]);
  }
}

// Device mode: buckets in the GPU's memory; every operation is queued on
// LibTorch's current stream of the calling thread (autograd's stream in a
// hook, the caller's in the end-of-backward callback).
class DeviceGradMemory final : public ddp::GradMemory {
 public:
  DeviceGradMemory(::torch::Device d, bool wait_on_stream) : dev_(d), wait_on_stream_(wait_on_stream) {}
  bool buckets_on_host() const override { return false; }
  bool grads_on_host() const override { return false; }
  std::shared_ptr<std::byte[]> allocate(ProcessGroup&, size_t n) override { return device_bytes(dev_, n); }
  void grad_to_bucket(void* bucket, const void* grad, size_t n) override { copy(bucket, grad, n); }
  void bucket_to_grad(void* grad, const void* bucket, size_t n) override { copy(grad, bucket, n); }
  void grads_to_buckets(std::span<const Copy> copies) override { copy_all(copies); }
  void buckets_to_grads(std::span<const Copy> copies) override { copy_all(copies); }
  uint64_t copy_queue() override {
    const c10::Stream now = stream_now();
    for (size_t i = 0; i < queues_.size(); ++i)
      if (queues_[i] == now) return i + 1;
    queues_.push_back(now);
    return queues_.size();
  }
  void zero_bucket(void* bucket, size_t n) override {
    ::torch::NoGradGuard no_grad;
    bytes(bucket, n, dev_).zero_();
  }
  void convert(Buffer dst, Buffer src, double divisor) override {
    ::torch::NoGradGuard no_grad;
    ::torch::Tensor s = view(src.data, src.count, src.dtype, dev_);
    ::torch::Tensor d = view(dst.data, dst.count, dst.dtype, dev_);
    if (divisor == 1.0)
      d.copy_(s);
    else if (dst.data == src.data && dst.dtype == src.dtype && dst.dtype != DType::F16 && dst.dtype != DType::BF16)
      d.div_(divisor);
    else  // divide in f32 (or f64) as the host hooks do, then round once
      d.copy_(s.to(src.dtype == DType::F64 ? ::torch::kDouble : ::torch::kFloat).div_(divisor));
  }
  void host_to_bucket(void* bucket, const void* host, size_t n) override {
    ::torch::NoGradGuard no_grad;
    bytes(bucket, n, dev_).copy_(bytes(host, n, ::torch::kCPU));  // from pageable memory: returns when read
  }
  void bucket_to_host(void* host, const void* bucket, size_t n) override {
    ::torch::NoGradGuard no_grad;
    bytes(host, n, ::torch::kCPU).copy_(bytes(bucket, n, dev_));  // to pageable memory: synchronous
  }
  // finalize runs in autograd's end-of-backward callback, where the current
  // stream is the one backward() was called on. wait_on_stream: that stream
  // (the optimizer's, the next forward's) waits for the allreduce and the
  // host goes on queueing; otherwise the host waits.
  void wait(Work& work, Millis timeout) override {
    if (wait_on_stream_)
      work.wait_on_stream(current_stream_handle(dev_), timeout);
    else
      work.wait(timeout);
  }

 private:
  void copy(void* dst, const void* src, size_t n) {
    ::torch::NoGradGuard no_grad;
    bytes(dst, n, dev_).copy_(bytes(src, n, dev_));
  }
  c10::Stream stream_now() const { return c10::impl::getDeviceGuardImpl(dev_.type())->getStream(dev_); }

  // The copies on the current stream, except those of gradients written on
  // another (copy_queue() said so when the reducer queued them: a backward
  // that runs parts on side streams): each such group is copied on its own
  // stream, and the current stream waits for it there, so that whatever
  // the current stream queues next (the bucket's collective) comes after.
  void copy_all(std::span<const Copy> copies) {
    const c10::Stream now = stream_now();
    const auto foreign = [&](const Copy& c) { return c.queue != 0 && queues_.at(c.queue - 1) != now; };
    if (std::none_of(copies.begin(), copies.end(), foreign)) return copy_batch(copies);  // the usual case
    std::vector<Copy> here;
    std::vector<uint64_t> elsewhere;
    for (const Copy& c : copies) {
      if (!foreign(c))
        here.push_back(c);
      else if (std::find(elsewhere.begin(), elsewhere.end(), c.queue) == elsewhere.end())
        elsewhere.push_back(c.queue);
    }
    for (const uint64_t q : elsewhere) {
      const c10::Stream there = queues_.at(q - 1);
      std::vector<Copy> group;
      for (const Copy& c : copies)
        if (c.queue == q) group.push_back(c);
      {
        c10::StreamGuard on(there);
        copy_batch(group);
      }
      c10::Event done(dev_.type());
      done.record(there);
      done.block(now);
    }
    copy_batch(here);
  }

  // One multi-tensor kernel for many copies: a copy_ each costs the host a
  // dispatch and a launch (some 10 us) per parameter, which a small model's
  // step waits for. As 32-bit words where address and length allow (16-byte
  // loads; integers, so every bit pattern is copied as is), the rest as bytes.
  void copy_batch(std::span<const Copy> copies) {
    if (copies.empty()) return;
    if (copies.size() == 1) return copy(copies[0].dst, copies[0].src, copies[0].bytes);
    const auto word_opts = ::torch::TensorOptions().dtype(::torch::kInt).device(dev_);
    std::vector<::torch::Tensor> words_to, words_from, bytes_to, bytes_from;
    for (const Copy& c : copies) {
      void* from = const_cast<void*>(c.src);
      if (((reinterpret_cast<uintptr_t>(c.dst) | reinterpret_cast<uintptr_t>(from) | c.bytes) & 3) == 0) {
        words_to.push_back(wrap(c.dst, {static_cast<int64_t>(c.bytes / 4)}, word_opts));
        words_from.push_back(wrap(from, {static_cast<int64_t>(c.bytes / 4)}, word_opts));
      } else {
        bytes_to.push_back(bytes(c.dst, c.bytes, dev_));
        bytes_from.push_back(bytes(from, c.bytes, dev_));
      }
    }
    ::torch::NoGradGuard no_grad;
    if (!words_to.empty()) foreach_copy<at::TensorList>(words_to, words_from);
    if (!bytes_to.empty()) foreach_copy<at::TensorList>(bytes_to, bytes_from);
  }
  ::torch::Device dev_;
  bool wait_on_stream_;
  std::vector<c10::Stream> queues_;  // copy_queue()'s tokens, less one: the streams marks came from
};

// Staged mode: host buckets (the group's memory, shared on one host);
// gradients come from the GPU and go back to it. Copies between the GPU and
// pageable host memory return when the data has arrived, so the group may
// read the bucket as soon as grad_to_bucket returns.
class StagedGradMemory final : public ddp::GradMemory {
 public:
  explicit StagedGradMemory(::torch::Device d) : dev_(d) {}
  bool buckets_on_host() const override { return true; }
  bool grads_on_host() const override { return false; }
  std::shared_ptr<std::byte[]> allocate(ProcessGroup& group, size_t n) override { return group.allocate_buffer(n); }
  void grad_to_bucket(void* bucket, const void* grad, size_t n) override {
    ::torch::NoGradGuard no_grad;
    bytes(bucket, n, ::torch::kCPU).copy_(bytes(grad, n, dev_));
  }
  void bucket_to_grad(void* grad, const void* bucket, size_t n) override {
    ::torch::NoGradGuard no_grad;
    bytes(grad, n, dev_).copy_(bytes(bucket, n, ::torch::kCPU));
  }
  void zero_bucket(void* bucket, size_t n) override { std::memset(bucket, 0, n); }

 private:
  ::torch::Device dev_;
};

}  // namespace

std::shared_ptr<std::byte[]> device_bytes(const ::torch::Device& device, size_t n) {
  // The tensor lives as long as the returned pointer (its deleter holds it).
  ::torch::Tensor t = ::torch::zeros({static_cast<int64_t>(std::max<size_t>(n, 1))}, bytes_on(device));
  auto* p = static_cast<std::byte*>(t.data_ptr());
  return std::shared_ptr<std::byte[]>(p, [t](std::byte*) mutable { t.reset(); });
}

std::shared_ptr<std::byte[]> own_bytes(ProcessGroup& group, MemoryMode mode, const ::torch::Device& device, size_t n,
                                       bool shared) {
  n = std::max<size_t>(n, 1);
  if (mode != MemoryMode::Host) return device_bytes(device, n);
  if (!shared) return std::shared_ptr<std::byte[]>(new std::byte[n]());
  return group.allocate_buffer(n);  // zeroed
}

void zero_own_bytes(std::byte* data, size_t bytes, MemoryMode mode, const ::torch::Device& device) {
  if (bytes == 0) return;
  if (mode == MemoryMode::Host) {
    std::memset(data, 0, bytes);
    return;
  }
  ::torch::NoGradGuard no_grad;
  wrap(data, {static_cast<int64_t>(bytes)}, bytes_on(device)).zero_();
}

namespace {
at::TensorMaker maker_for(void* data, ::torch::IntArrayRef sizes, const ::torch::TensorOptions& options) {
  auto maker = at::for_blob(data, sizes);
  maker.options(options);
  // A device with its index is where the memory is (the caller's word); a
  // CPU pointer needs no driver call either way.
  if (options.device().has_index()) maker.target_device(options.device());
  return maker;
}
}  // namespace

::torch::Tensor wrap(void* data, ::torch::IntArrayRef sizes, const ::torch::TensorOptions& options) {
  return maker_for(data, sizes, options).make_tensor();
}

::torch::Tensor wrap(void* data, ::torch::IntArrayRef sizes, const ::torch::TensorOptions& options,
                     std::shared_ptr<std::byte[]> owner) {
  return maker_for(data, sizes, options).deleter([owner = std::move(owner)](void*) {}).make_tensor();
}

::torch::ScalarType to_scalar_type(DType t) {
  switch (t) {
    case DType::F32: return ::torch::kFloat;
    case DType::F64: return ::torch::kDouble;
    case DType::F16: return ::torch::kHalf;
    case DType::BF16: return ::torch::kBFloat16;
    case DType::I8: return ::torch::kChar;
    case DType::U8: return ::torch::kByte;
    case DType::I32: return ::torch::kInt;
    case DType::I64: return ::torch::kLong;
  }
  throw InvalidArgument(fmt::format("no LibTorch dtype for cohort dtype {}", static_cast<int>(t)));
}

::torch::Device common_device(const std::vector<std::string>& names, const std::vector<::torch::Tensor>& tensors,
                              const char* who) {
  std::optional<::torch::Device> first;
  size_t first_at = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const ::torch::Device d = tensors[i].device();
    if (!d.is_cpu() && !d.is_cuda())
      throw InvalidArgument(fmt::format(
          "{}: '{}' is on {}; cohort trains modules on the CPU or on a CUDA GPU. HINT: move the module with "
          "module->to(torch::kCPU) or module->to(torch::Device(torch::kCUDA, local_rank))",
          who, names[i], device_text(d)));
    if (!first) {
      first = d;
      first_at = i;
    } else if (d != *first) {
      throw InvalidArgument(fmt::format(
          "{}: the module is split across devices: '{}' is on {} but '{}' is on {}; data parallelism "
          "trains a module that lives on one device. HINT: move the whole module to one device "
          "(module->to(device)) before wrapping it; a model split across GPUs needs pipeline or tensor parallelism",
          who, names[first_at], device_text(*first), names[i], device_text(d)));
    }
  }
  return first.value_or(::torch::Device(::torch::kCPU));
}

namespace {
std::atomic<bool> device_mode_on_cpu_flag{false};
}  // namespace

void testing::set_device_mode_on_cpu(bool on) { device_mode_on_cpu_flag = on; }
bool testing::device_mode_on_cpu() { return device_mode_on_cpu_flag.load(); }

MemoryMode memory_mode(const ::torch::Device& device, const ProcessGroup& group, const char* who) {
  const int gpu = group.cuda_device();
  if (device.is_cpu()) {
    if (gpu < 0) return testing::device_mode_on_cpu() ? MemoryMode::Device : MemoryMode::Host;
    throw InvalidArgument(fmt::format(
        "{}: the module is on the CPU but the process group's backend ({}) moves GPU memory only (cuda:{}). "
        "HINT: move the module to that GPU (module->to(torch::Device(torch::kCUDA, {}))), or train on the CPU with "
        "COHORT_BACKEND=native",
        who, group.backend_name(), gpu, gpu));
  }
  if (gpu >= 0 && device.index() != gpu)
    throw InvalidArgument(fmt::format(
        "{}: the module is on {} but this rank's {} group uses cuda:{} (LOCAL_RANK's GPU). HINT: move the "
        "module with module->to(torch::Device(torch::kCUDA, {})); one process per GPU",
        who, device_text(device), group.backend_name(), gpu, gpu));
  if (gpu < 0) return MemoryMode::Staged;  // no streams involved: host copies only
  if (!HasNativeHandle<c10::Stream>)
    throw InvalidArgument(fmt::format(
        "{}: a CUDA module on the nccl backend needs LibTorch 2.1 or newer (c10::Stream::native_handle, to order "
        "NCCL after LibTorch's stream); HINT: use a newer LibTorch, or COHORT_BACKEND=native (gradients staged "
        "through host memory)",
        who));
  return MemoryMode::Device;
}

std::shared_ptr<ddp::GradMemory> grad_memory(MemoryMode mode, const ::torch::Device& device, bool wait_on_stream) {
  switch (mode) {
    case MemoryMode::Host: return nullptr;
    case MemoryMode::Device: return std::make_shared<DeviceGradMemory>(device, wait_on_stream);
    case MemoryMode::Staged: return std::make_shared<StagedGradMemory>(device);
  }
  return nullptr;
}

void* current_stream_handle(const ::torch::Device& device) {
  if (!device.is_cuda()) return nullptr;
  return native_handle(c10::impl::getDeviceGuardImpl(device.type())->getStream(device));
}

::torch::Tensor in_group_memory(const ProcessGroup& group, const ::torch::Tensor& t) {
  const int gpu = group.cuda_device();
  const ::torch::Device want = gpu >= 0 ? ::torch::Device(::torch::kCUDA, static_cast<c10::DeviceIndex>(gpu))
                                        : ::torch::Device(::torch::kCPU);
  if (t.device() == want && t.is_contiguous()) return t;
  return t.to(want).contiguous();
}

void wait_keeping(const WorkPtr& work, std::vector<::torch::Tensor> keep) {
  try {
    work->wait();
  } catch (...) {
    (void)new std::vector<::torch::Tensor>(std::move(keep));
    throw;
  }
}

void host_collective(ProcessGroup& group, const std::vector<Buffer>& host,
                     const std::function<WorkPtr(const std::vector<Buffer>&)>& issue) {
  const int gpu = group.cuda_device();
  if (gpu < 0) {
    issue(host)->wait();
    return;
  }
  const ::torch::Device dev(::torch::kCUDA, static_cast<c10::DeviceIndex>(gpu));
  std::vector<::torch::Tensor> on_gpu;
  std::vector<Buffer> bufs;
  for (const Buffer& h : host) {
    on_gpu.push_back(bytes(h.data, h.bytes(), ::torch::kCPU).to(dev));
    bufs.push_back({on_gpu.back().data_ptr(), h.count, h.dtype});
  }
  try {
    CudaStreamScope scope(current_stream_handle(dev));  // the uploads above are queued there
    issue(bufs)->wait();
  } catch (...) {
    // NCCL may still write into them (a timeout, a failed peer): never free them under it.
    (void)new std::vector<::torch::Tensor>(std::move(on_gpu));
    throw;
  }
  for (size_t i = 0; i < host.size(); ++i)
    if (host[i].bytes() > 0) std::memcpy(host[i].data, on_gpu[i].cpu().data_ptr(), host[i].bytes());
}

}  // namespace cohort::torch
