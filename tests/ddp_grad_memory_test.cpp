// The reducer's device path (ReducerOptions::memory, as the LibTorch adapter
// uses for a module on a GPU), run without a GPU: a GradMemory that says its
// buckets and gradients are device memory, backed by host memory and counting
// every call. It shows that with such memory the reducer never touches a
// gradient or bucket byte itself (everything goes through the memory), that
// its control collectives are staged through bucket memory, and that the
// compression hooks convert through it; the results are the same closed-form
// averages as on the host. The real CUDA memory is exercised by
// tests/torch/ddp_cuda_test.cpp on a GPU (scripts/gpu-check.sh).
#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <set>

#include "core/reduce.hpp"
#include "ddp_test_util.hpp"

namespace cohort::ddp {
namespace {

using namespace test;
using cohort::testing::run_ranks;

// One element of a floating-point buffer, through double.
double load(const void* p, size_t i, DType t) {
  switch (t) {
    case DType::F32: return static_cast<const float*>(p)[i];
    case DType::F64: return static_cast<const double*>(p)[i];
    case DType::F16: return core::half_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::BF16: return core::bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: ADD_FAILURE() << "convert of " << dtype_name(t); return 0;
  }
}
void store(void* p, size_t i, DType t, double v) {
  switch (t) {
    case DType::F32: static_cast<float*>(p)[i] = static_cast<float>(v); return;
    case DType::F64: static_cast<double*>(p)[i] = v; return;
    case DType::F16: static_cast<uint16_t*>(p)[i] = core::float_to_half(static_cast<float>(v)); return;
    case DType::BF16: static_cast<uint16_t*>(p)[i] = core::float_to_bf16(static_cast<float>(v)); return;
    default: ADD_FAILURE() << "convert to " << dtype_name(t);
  }
}

// "Device" memory: host bytes handed out by allocate() only. Copies check
// that their bucket side lies in memory it allocated.
class CountingDeviceMemory final : public GradMemory {
 public:
  bool buckets_on_host() const override { return false; }
  bool grads_on_host() const override { return false; }
  std::shared_ptr<std::byte[]> allocate(ProcessGroup&, size_t bytes) override {
    ++allocations;
    // Plain heap memory, not the group's shared buffers: a device bucket is not something peers map.
    auto p = std::shared_ptr<std::byte[]>(new std::byte[bytes + 64]());
    regions.push_back({p.get(), bytes + 64});
    return p;
  }
  void grad_to_bucket(void* bucket, const void* grad, size_t bytes) override {
    counted_copy(grad_to_bucket_calls, bucket, bucket, grad, bytes);
  }
  void bucket_to_grad(void* grad, const void* bucket, size_t bytes) override {
    counted_copy(bucket_to_grad_calls, bucket, grad, bucket, bytes);
  }
  void grads_to_buckets(std::span<const Copy> copies) override {
    if (fail_batches) throw Error("out of device memory (a stand-in failure)");
    ++grads_batches;
    for (const Copy& c : copies) {
      // Each copy names the queue that was current when the reducer took it.
      const auto it = queue_of.find(c.dst);
      if (it != queue_of.end()) {
        EXPECT_EQ(c.queue, it->second);
      }
      counted_copy(grads_batched, c.dst, c.dst, c.src, c.bytes);
    }
  }
  void buckets_to_grads(std::span<const Copy> copies) override {
    ++results_batches;
    for (const Copy& c : copies) {
      EXPECT_EQ(c.queue, 0u);  // the results go on whatever queue finalize runs on
      counted_copy(results_batched, c.src, c.dst, c.src, c.bytes);
    }
  }
  uint64_t copy_queue() override { return queue; }
  bool fail_batches = false;
  uint64_t queue = 0;                          // what copy_queue() says now (a stand-in for the current stream)
  std::map<const void*, uint64_t> queue_of;    // by bucket slot: the queue current at its mark
  void zero_bucket(void* bucket, size_t bytes) override {
    expect_bucket(bucket, bytes);
    ++zero_calls;
    std::memset(bucket, 0, bytes);
  }
  void convert(Buffer dst, Buffer src, double divisor) override {
    expect_bucket(dst.data, dst.bytes());
    expect_bucket(src.data, src.bytes());
    ++convert_calls;
    ASSERT_EQ(dst.count, src.count);
    // Divided in double, then one rounding into dst's type.
    for (size_t i = 0; i < src.count; ++i) store(dst.data, i, dst.dtype, load(src.data, i, src.dtype) / divisor);
  }
  void host_to_bucket(void* bucket, const void* host, size_t bytes) override {
    counted_copy(staged_in, bucket, bucket, host, bytes);
  }
  void bucket_to_host(void* host, const void* bucket, size_t bytes) override {
    counted_copy(staged_out, bucket, host, bucket, bytes);
  }

  int allocations = 0, grad_to_bucket_calls = 0, bucket_to_grad_calls = 0, zero_calls = 0, convert_calls = 0;
  int staged_in = 0, staged_out = 0;
  int grads_batches = 0, grads_batched = 0, results_batches = 0, results_batched = 0;

 private:
  // A copy one of whose sides (`bucket`) must be memory this allocated.
  void counted_copy(int& calls, const void* bucket, void* dst, const void* src, size_t bytes) {
    expect_bucket(bucket, bytes);
    ++calls;
    std::memcpy(dst, src, bytes);
  }
  void expect_bucket(const void* p, size_t bytes) const {
    const auto* b = static_cast<const std::byte*>(p);
    for (const auto& [start, size] : regions)
      if (b >= start && b + bytes <= start + size) return;
    ADD_FAILURE() << "a bucket-side pointer outside the memory's allocations";
  }
  std::vector<std::pair<const std::byte*, size_t>> regions;
};

// small_buckets() over a fresh counting memory, which `mem` receives.
ReducerOptions in_counting_memory(std::shared_ptr<CountingDeviceMemory>& mem) {
  mem = std::make_shared<CountingDeviceMemory>();
  ReducerOptions o = small_buckets();
  o.memory = mem;
  return o;
}

class GradMemoryTest : public ::testing::TestWithParam<Config> {};

TEST_P(GradMemoryTest, EveryByteMovesThroughTheMemoryAndTheAverageIsExact) {
  auto [transport, n] = GetParam();
  for (const bool valid_until_finalize : {false, true}) {
    run_ranks(n, transport, [&](ProcessGroup& pg) {
      const int r = pg.rank();
      Grads g(mixed_model());
      std::shared_ptr<CountingDeviceMemory> mem;
      ReducerOptions o = in_counting_memory(mem);
      // Device gradients are never read in place (the group reads buckets
      // only); gradients that stay valid are copied in one batch per bucket.
      o.grads_valid_until_finalize = valid_until_finalize;
      Reducer red(pg, g.specs, o);
      EXPECT_GE(mem->allocations, 1);
      // The construction check (an allgather of signatures) went through bucket memory.
      EXPECT_EQ(mem->staged_in, n > 1 ? 2 : 0);
      const size_t np = g.specs.size();
      size_t nonempty = 0;
      for (const ParamSpec& s : g.specs) nonempty += s.count > 0;
      for (int t = 0; t < 2; ++t) {
        g.fill([&](size_t p, size_t i) { return grad_value(r, p, i, t); });
        for (size_t p : shuffled(np, 31 * r + t)) {
          mem->queue = 1 + (p + t) % 3;  // marks from three streams
          if (g.specs[p].count > 0) mem->queue_of[red.bucket_slot(p)] = mem->queue;  // (an empty one shares its slot)
          red.mark_ready(p, g.ptr(p));
        }
        red.finalize();
        expect_values(g.specs, r, "device memory", [&](size_t p, size_t i) { return g.at(p, i); },
                      [&](size_t p, size_t i) { return avg_value(n, p, i, t); });
      }
      // Every result goes back in one batch per finalize.
      EXPECT_EQ(mem->bucket_to_grad_calls, 0);
      EXPECT_EQ(mem->results_batches, 2);
      EXPECT_EQ(mem->results_batched, static_cast<int>(2 * nonempty));
      if (!valid_until_finalize) {
        // A gradient that may change after mark_ready is copied at once.
        EXPECT_EQ(mem->grad_to_bucket_calls, static_cast<int>(2 * nonempty));
        EXPECT_EQ(mem->grads_batches, 0);
        return;
      }
      // One batch per bucket that has bytes, at its launch.
      size_t with_bytes = 0;
      for (const PlannedBucket& b : red.plan())
        with_bytes += std::any_of(b.params.begin(), b.params.end(), [&](size_t p) { return g.specs[p].count > 0; });
      EXPECT_EQ(mem->grad_to_bucket_calls, 0);
      EXPECT_EQ(mem->grads_batches, static_cast<int>(2 * with_bytes));
      EXPECT_EQ(mem->grads_batched, static_cast<int>(2 * nonempty));
    });
  }
}

TEST_P(GradMemoryTest, UnusedParametersAndTheUsedMapGoThroughTheMemory) {
  auto [transport, n] = GetParam();
  // (valid_until_finalize: the unused parameters' registered gradients join their buckets' batches.)
  for (const bool valid_until_finalize : {false, true}) {
    run_ranks(n, transport, [&](ProcessGroup& pg) {
      const int r = pg.rank();
      Grads g(mixed_model());
      const size_t never = 9, registered = 0;
      g.specs[never].grad = nullptr;
      auto mem = std::make_shared<CountingDeviceMemory>();
      ReducerOptions o = small_buckets();
      o.find_unused_parameters = true;
      o.memory = mem;
      o.grads_valid_until_finalize = valid_until_finalize;
      Reducer red(pg, g.specs, o);
      const int staged_before = mem->staged_in;
      g.fill([&](size_t p, size_t i) { return grad_value(r, p, i, 0); });
      mem->queue = 4;  // the marks' stream; finalize runs on another
      for (size_t p = g.specs.size(); p-- > 0;) {
        if (p == never || p == registered) continue;
        if (g.specs[p].count > 0) mem->queue_of[red.bucket_slot(p)] = 4;
        red.mark_ready(p, g.ptr(p));
      }
      mem->queue = 9;
      mem->queue_of[red.bucket_slot(registered)] = 9;  // copied in by finalize, on its stream
      red.finalize();
      EXPECT_EQ(mem->zero_calls, 1);  // `never`: no gradient anywhere, zeros
      if (valid_until_finalize) {
        // `registered` joins its bucket's batch from finalize: no copy on its own, none twice.
        EXPECT_EQ(mem->grad_to_bucket_calls, 0);
        int copied = 0;  // every parameter with bytes but `never` (zeroed instead)
        for (size_t p = 0; p < g.specs.size(); ++p) copied += p != never && g.specs[p].count > 0;
        EXPECT_EQ(mem->grads_batched, copied);
      } else {
        EXPECT_EQ(mem->grads_batches, 0);
      }
      EXPECT_EQ(mem->staged_in, staged_before + 1);  // the used map, allreduced in bucket memory
      EXPECT_EQ(mem->staged_out, mem->staged_in);
      EXPECT_FALSE(red.used_anywhere(never));
      EXPECT_TRUE(red.used_anywhere(registered));
      auto got = [&](size_t p, size_t i) {
        return p == never ? get_value(red.bucket_slot(p), i, g.specs[p].dtype) : g.at(p, i);
      };
      expect_values(g.specs, r, "device find_unused", got,
                    [&](size_t p, size_t i) { return p == never ? 0.0 : avg_value(n, p, i, 0); });
    });
  }
}

TEST_P(GradMemoryTest, CompressionHooksConvertThroughTheMemory) {
  auto [transport, n] = GetParam();
  for (auto [hook, name] : {std::pair{fp16_compress_hook(), "fp16"}, std::pair{bf16_compress_hook(), "bf16"}}) {
    run_ranks(n, transport, [&](ProcessGroup& pg) {
      const int r = pg.rank();
      Grads g(mixed_model());
      std::shared_ptr<CountingDeviceMemory> mem;
      ReducerOptions o = in_counting_memory(mem);
      o.comm_hook = hook;
      Reducer red(pg, g.specs, o);
      g.fill([&](size_t p, size_t i) { return grad_value(r, p, i, 0); });
      for (size_t p : shuffled(g.specs.size(), 7 * r)) red.mark_ready(p, g.ptr(p));
      red.finalize();
      expect_values(g.specs, r, name, [&](size_t p, size_t i) { return g.at(p, i); },
                    [&](size_t p, size_t i) { return avg_value(n, p, i, 0); });
      // Every non-empty bucket: one conversion after the sum, one before it
      // unless the bucket already is in the compressed type.
      EXPECT_GE(mem->convert_calls, static_cast<int>(red.plan().size()));
    });
  }
  // A value the compressed type rounds away: the bytes really travelled compressed.
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    std::vector<float> w(1000, 1.0f + 1.0f / 4096);
    ReducerOptions o;
    o.memory = std::make_shared<CountingDeviceMemory>();
    o.comm_hook = fp16_compress_hook();
    Reducer red(pg, {{"w", w.size(), DType::F32, w.data()}}, o);
    red.mark_ready(0, w.data());
    red.finalize();
    for (size_t i = 0; i < w.size(); ++i) ASSERT_EQ(w[i], 1.0f) << "rank " << pg.rank() << " element " << i;
  });
}

// A batch of copies that fails when its bucket launches: the mark that
// launched it throws the cause, and the reducer refuses to go on (no
// collective was issued for the bucket, so the ranks no longer agree).
TEST_P(GradMemoryTest, ABatchThatFailsStopsTheReducerWithItsCause) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    Grads g(mixed_model());
    std::shared_ptr<CountingDeviceMemory> mem;
    ReducerOptions o = in_counting_memory(mem);
    o.grads_valid_until_finalize = true;
    Reducer red(pg, g.specs, o);
    mem->fail_batches = true;
    bool thrown = false;
    for (size_t p = g.specs.size(); p-- > 0 && !thrown;) {
      try {
        red.mark_ready(p, g.ptr(p));
      } catch (const Error& e) {
        thrown = true;
        EXPECT_NE(std::string(e.what()).find("stand-in failure"), std::string::npos) << e.what();
      }
    }
    EXPECT_TRUE(thrown);
    try {
      red.finalize();
      ADD_FAILURE() << "finalize after a failed launch returned";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("can no longer be used"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("stand-in failure"), std::string::npos) << e.what();
    }
  });
}

// ZeRO-2 on a GPU: recycled buckets (ReducerOptions::recycled_buckets) in
// device memory. Pool buffers come from the memory, every gradient goes in
// through it at once (it may be freed right after), a nullptr mark and a
// bucket's padding are zeroed through it, and the hook's `then` sees each
// exact average before the buffer is reused.
TEST_P(GradMemoryTest, RecycledBucketsInDeviceMemory) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    Grads g(mixed_model());
    std::shared_ptr<CountingDeviceMemory> mem;
    ReducerOptions o = in_counting_memory(mem);
    o.grads_valid_until_finalize = false;
    o.recycled_buckets = 1;
    o.bucket_count_multiple = 3;  // padding, as ZeRO's
    Grads results(mixed_model());
    o.comm_hook = [&](GradBucket& b) -> CommFuture {
      WorkPtr w = b.allreduce({.op = ReduceOp::Avg});
      return {w, [&results, buffer = b.buffer(), params = std::vector<size_t>(b.params().begin(), b.params().end()),
                  offsets = std::vector<size_t>(b.offsets().begin(), b.offsets().end())] {
                for (size_t k = 0; k < params.size(); ++k) {
                  const size_t es = dtype_size(buffer.dtype);
                  std::memcpy(results.ptr(params[k]), static_cast<const std::byte*>(buffer.data) + offsets[k] * es,
                              results.specs[params[k]].count * es);
                }
              }};
    };
    Reducer red(pg, g.specs, o);
    const int constructed = mem->allocations;
    size_t nonempty = 0;
    for (const ParamSpec& s : g.specs) nonempty += s.count > 0;
    for (int t = 0; t < 2; ++t) {
      g.fill([&](size_t p, size_t i) { return grad_value(r, p, i, t); });
      for (size_t p = g.specs.size(); p-- > 0;) red.mark_ready(p, t == 1 && p == 8 ? nullptr : g.ptr(p));
      ASSERT_TRUE(red.finalize());
      expect_values(g.specs, r, "recycled in device memory, iteration " + std::to_string(t),
                    [&](size_t p, size_t i) { return results.at(p, i); },
                    [&](size_t p, size_t i) { return t == 1 && p == 8 ? 0.0 : avg_value(n, p, i, t); });
    }
    EXPECT_GT(mem->allocations, constructed) << "the pool's buffers come from the memory";
    EXPECT_EQ(mem->grad_to_bucket_calls, static_cast<int>(2 * nonempty - 1)) << "each gradient through the memory";
    EXPECT_GE(mem->zero_calls, 1) << "the nullptr mark's slot is zeroed through the memory";
    EXPECT_EQ(mem->grads_batches, 0);
    EXPECT_EQ(mem->results_batches, 0) << "the hook is the results' only reader";
  });
  // Gradients staged between host buckets and device memory cannot recycle:
  // a .grad on the device would be freed before its copy to the host bucket.
  run_ranks(1, transport, [&](ProcessGroup& pg) {
    struct Staged final : GradMemory {
      bool buckets_on_host() const override { return true; }
      bool grads_on_host() const override { return false; }
      std::shared_ptr<std::byte[]> allocate(ProcessGroup& group, size_t bytes) override { return group.allocate_buffer(bytes); }
      void grad_to_bucket(void* b, const void* g, size_t bytes) override { std::memcpy(b, g, bytes); }
      void bucket_to_grad(void* g, const void* b, size_t bytes) override { std::memcpy(g, b, bytes); }
      void zero_bucket(void* b, size_t bytes) override { std::memset(b, 0, bytes); }
    };
    ReducerOptions o;
    o.memory = std::make_shared<Staged>();
    o.recycled_buckets = 1;
    o.comm_hook = [](GradBucket& b) -> CommFuture { return {b.allreduce({.op = ReduceOp::Avg}), [] {}}; };
    const std::vector<ParamSpec> specs{{"w", 4, DType::F32}};
    try {
      Reducer red(pg, specs, o);
      ADD_FAILURE() << "recycled buckets with staged gradients were accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("staged"), std::string::npos) << e.what();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(All, GradMemoryTest, ::testing::ValuesIn(configs()), config_name);

TEST(HostGradMemory, DeviceOnlyCallsAreRefused) {
  auto host = host_grad_memory();
  EXPECT_TRUE(host->buckets_on_host());
  float x[2] = {1, 2};
  EXPECT_THROW(host->convert({x, 2, DType::F32}, {x, 2, DType::F32}, 2.0), Error);
  EXPECT_THROW(host->host_to_bucket(x, x, sizeof x), Error);
}

}  // namespace
}  // namespace cohort::ddp
