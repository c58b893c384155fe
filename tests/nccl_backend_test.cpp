// The NCCL backend (docs/nccl.md). Everywhere: init_process_group("nccl")
// fails with a clear InvalidArgument when the build has no NCCL or the machine
// has no GPU, and records that failure in the store for the other ranks. On a
// machine with GPUs (and a CUDA build) the collectives run for real, ranks as
// threads with one GPU each; elsewhere those tests skip and say why.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "cohort/cohort.hpp"
#include "group/nccl/nccl_group.hpp"
#include "launch_harness.hpp"

#ifdef COHORT_HAVE_CUDA
#include <cuda_runtime.h>

#include "group/nccl/nccl_util.hpp"
#endif

namespace cohort {
namespace {

int visible_gpus() {
#ifdef COHORT_HAVE_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

InitOptions nccl_options(int rank, int size, std::shared_ptr<Store> store) {
  InitOptions o;
  o.backend = "nccl";
  o.rank = rank;
  o.world_size = size;
  o.store = std::move(store);
  o.timeout = Millis(60000);
  return o;
}

TEST(NcclBackend, InitFailsClearlyWithoutNcclOrGpu) {
  if (group::nccl_backend_built() && visible_gpus() > 0)
    GTEST_SKIP() << "a GPU is visible: the GPU tests below run instead";
  auto store = std::make_shared<MemoryStore>();
  try {
    init_process_group(nccl_options(0, 1, store));
    FAIL() << "init_process_group with backend nccl succeeded without NCCL or a GPU";
  } catch (const InvalidArgument& e) {
    std::string what = e.what();
    if (group::nccl_backend_built()) {
      EXPECT_NE(what.find("needs a CUDA GPU"), std::string::npos) << what;
      EXPECT_NE(what.find("cudaGetDeviceCount"), std::string::npos) << what;
      // The other ranks learn about it from the store instead of waiting for their timeout.
      EXPECT_TRUE(store->check({"cohort/0/g0/failure"}));
    } else {
      EXPECT_NE(what.find("this build has no NCCL backend: rebuild with -DCOHORT_CUDA=ON"), std::string::npos) << what;
    }
  }
}

TEST(NcclBackend, EveryRankOfAGroupFailsWithoutGpu) {
  if (group::nccl_backend_built() && visible_gpus() > 0) GTEST_SKIP() << "a GPU is visible";
  auto store = std::make_shared<MemoryStore>();
  std::vector<std::string> errors(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      try {
        init_process_group(nccl_options(r, 2, store));
      } catch (const InvalidArgument& e) {
        errors[r] = e.what();
      } catch (const std::exception& e) {
        errors[r] = std::string("wrong exception type: ") + e.what();
      }
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("nccl"), std::string::npos) << "rank " << r << ": " << errors[r];
    EXPECT_EQ(errors[r].find("wrong exception type"), std::string::npos) << errors[r];
  }
}

// `cohort bench --device cuda` through the launcher: refused clearly without
// CUDA or a GPU; with GPUs, every element checked (-c 1) on up to 2 of them.
TEST(NcclBackend, BenchDeviceCuda) {
  const int gpus = group::nccl_backend_built() ? visible_gpus() : 0;
  const int n = std::max(1, std::min(gpus, 2));
  auto r = launch_test::run({"run", "--standalone", "--nproc-per-node", std::to_string(n), COHORT_BIN, "bench",
                             "allreduce", "--device", "cuda", "--sizes", "0,8,4K,2M", "-n", "2", "-w", "1", "-c", "1"},
                            {{"COHORT_TIMEOUT", "60s"}}, 120);
  if (gpus > 0) {
    EXPECT_EQ(r.status, 0) << r.out << r.err;
    EXPECT_NE(r.out.find("# Out of bounds values : 0 OK"), std::string::npos) << r.out << r.err;
    return;
  }
  EXPECT_NE(r.status, 0) << r.out;
  const std::string want = group::nccl_backend_built() ? "needs a CUDA GPU" : "this cohort was built without CUDA";
  EXPECT_NE(r.err.find(want), std::string::npos) << r.err;
}

#ifdef COHORT_HAVE_CUDA

// NCCL numbers max before min and has its own dtype numbers: the tables must map by name.
TEST(NcclBackend, TypeAndOpTablesMatchNcclByName) {
  using group::nccl::to_nccl;
  EXPECT_EQ(to_nccl(ReduceOp::Sum), ncclSum);
  EXPECT_EQ(to_nccl(ReduceOp::Prod), ncclProd);
  EXPECT_EQ(to_nccl(ReduceOp::Min), ncclMin);
  EXPECT_EQ(to_nccl(ReduceOp::Max), ncclMax);
  EXPECT_EQ(to_nccl(ReduceOp::Avg), ncclAvg);
  EXPECT_EQ(to_nccl(DType::F32), ncclFloat32);
  EXPECT_EQ(to_nccl(DType::F64), ncclFloat64);
  EXPECT_EQ(to_nccl(DType::F16), ncclFloat16);
  EXPECT_EQ(to_nccl(DType::BF16), ncclBfloat16);
  EXPECT_EQ(to_nccl(DType::I8), ncclInt8);
  EXPECT_EQ(to_nccl(DType::U8), ncclUint8);
  EXPECT_EQ(to_nccl(DType::I32), ncclInt32);
  EXPECT_EQ(to_nccl(DType::I64), ncclInt64);
  EXPECT_THROW(to_nccl(static_cast<DType>(99)), InvalidArgument);
}

// Without a GPU, cudaPointerGetAttributes fails: the check still says what it needed.
TEST(NcclBackend, DeviceBufferCheckNamesTheBuffer) {
  std::vector<float> host(4);
  try {
    group::nccl::check_device_buffer(Buffer{host.data(), host.size(), DType::F32}, 0, "rank 0: allreduce", "send");
    FAIL() << "a host buffer passed the device check";
  } catch (const InvalidArgument& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("rank 0: allreduce"), std::string::npos) << what;
    EXPECT_NE(what.find("send buffer"), std::string::npos) << what;
    EXPECT_NE(what.find("cudaMalloc"), std::string::npos) << what;
  }
  EXPECT_NO_THROW(group::nccl::check_device_buffer(Buffer{nullptr, 0, DType::F32}, 0, "allreduce", "send"));
}

// Runs fn on n threads, each rank of an NCCL world group on GPU rank % gpus.
void run_gpu_ranks(int n, const std::function<void(ProcessGroup&)>& fn) {
  auto store = std::make_shared<MemoryStore>();
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        auto pg = init_process_group(nccl_options(r, n, store));
        fn(*pg);
        pg->shutdown();
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : ts) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

struct DeviceFloats {
  float* p = nullptr;
  size_t n = 0;
  explicit DeviceFloats(size_t count) : n(count) {
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(1, n) * sizeof(float)), cudaSuccess);
  }
  ~DeviceFloats() { cudaFree(p); }
  void put(const std::vector<float>& v) {
    ASSERT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<float> get() const {
    std::vector<float> v(n);
    EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
  Buffer buf() { return Buffer{p, n, DType::F32}; }
};

int gpu_ranks() {
  return std::min(visible_gpus(), 4);
}

TEST(NcclBackend, HostPointerIsRejectedNamingTheBuffer) {
  if (gpu_ranks() < 1) GTEST_SKIP() << "no GPU visible";
  run_gpu_ranks(1, [](ProcessGroup& pg) {
    std::vector<float> host(16, 1.0f);
    DeviceFloats dev(16);
    try {
      pg.allreduce(dev.buf(), Buffer{host.data(), host.size(), DType::F32})->wait();
      ADD_FAILURE() << "a host recv buffer was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("recv buffer"), std::string::npos) << e.what();
    }
    pg.barrier()->wait();  // the group stays usable after bad arguments
  });
}

// Host exchanges beside nccl (ProcessGroup::host_group): a native group of
// the same ranks, made once and kept; a sharded checkpoint is saved and
// found over it, as ZeroOptimizer's on a GPU (docs/zero.md).
TEST(NcclBackend, HostGroupCarriesHostExchangesAndShardedCheckpoints) {
  if (gpu_ranks() < 1) GTEST_SKIP() << "no GPU visible";
  const auto dir = std::filesystem::temp_directory_path() / ("nccl_host_group." + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  run_gpu_ranks(1, [&](ProcessGroup& pg) {
    ProcessGroup& host = pg.host_group();
    EXPECT_EQ(host.backend_name(), "native");
    EXPECT_EQ(host.size(), pg.size());
    EXPECT_EQ(host.rank(), pg.rank());
    EXPECT_EQ(&pg.host_group(), &host) << "made once";
    int64_t mine = 7, all = 0;
    host.allgather(Buffer{&mine, 1, DType::I64}, Buffer{&all, 1, DType::I64})->wait();
    EXPECT_EQ(all, 7);
    const std::vector<float> v{1, 2, 3};
    Manifest m;
    m.world_size = pg.size();
    const std::string path = save_checkpoint_sharded(
        pg, dir.string(), 3, {{"part.rank0", {make_tensor("values", {3}, v)}}}, m);
    const auto found = find_latest_valid(pg, dir.string());
    ASSERT_TRUE(found.has_value());
    EXPECT_EQ(found->path, path);
    EXPECT_EQ(found->step, 3);
  });
  std::filesystem::remove_all(dir);
}

TEST(NcclBackend, CollectivesGiveClosedFormResults) {
  const int n = gpu_ranks();
  if (n < 1) GTEST_SKIP() << "no GPU visible";
  for (size_t count : {size_t(0), size_t(1), size_t(1000), size_t(1) << 20})
    run_gpu_ranks(n, [count](ProcessGroup& pg) {
      const int me = pg.rank(), size = pg.size();
      DeviceFloats a(count);
      std::vector<float> in(count);
      for (size_t i = 0; i < count; ++i) in[i] = float((me + 1) * (i % 7 + 1));
      a.put(in);
      pg.allreduce(a.buf())->wait();
      auto out = a.get();
      for (size_t i = 0; i < count; ++i)
        ASSERT_EQ(out[i], float((i % 7 + 1) * size * (size + 1) / 2)) << "allreduce i=" << i;

      a.put(in);
      pg.broadcast(a.buf(), {.root = size - 1})->wait();
      out = a.get();
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(out[i], float(size * (i % 7 + 1))) << "broadcast i=" << i;

      DeviceFloats all(count * size);
      a.put(in);
      pg.allgather(a.buf(), all.buf())->wait();
      out = all.get();
      for (size_t i = 0; i < count * size; ++i)
        ASSERT_EQ(out[i], float((i / count + 1) * ((i % count) % 7 + 1))) << "allgather i=" << i;

      // alltoall in place: block j of rank r holds r * 1000 + j; afterwards block i holds i * 1000 + me.
      std::vector<float> blocks(count * size);
      for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = float(me * 1000 + (count ? i / count : 0));
      all.put(blocks);
      pg.alltoall(all.buf(), all.buf())->wait();
      out = all.get();
      for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], float((i / count) * 1000 + me)) << "alltoall i=" << i;

      DeviceFloats gathered(me == 0 ? count * size : 0);
      a.put(in);
      pg.gather(a.buf(), gathered.buf(), {.root = 0})->wait();
      if (me == 0) {
        out = gathered.get();
        for (size_t i = 0; i < out.size(); ++i)
          ASSERT_EQ(out[i], float((i / count + 1) * ((i % count) % 7 + 1))) << "gather i=" << i;
      }
      pg.barrier()->wait();
    });
}

// DDP's wait_on_stream waits this way (docs/gpu.md): a stream waits on the
// GPU for the operation, the host does not. An out-of-place allreduce into b
// is held back by work queued first on the legacy default stream (the NCCL
// stream waits for it); a copy of b queued on another, non-blocking stream
// after wait_on_stream must see the result, where without the wait it would
// run at once and copy the zeros b starts with. Operations never waited on
// the host then leave the group healthy (the watchdog drops them as they
// complete; shutdown drains cleanly).
TEST(NcclBackend, WaitOnStreamOrdersTheStreamNotTheHost) {
  if (gpu_ranks() < 1) GTEST_SKIP() << "no GPU visible";
  run_gpu_ranks(1, [](ProcessGroup& pg) {
    constexpr size_t n = size_t(16) << 20;  // 64 MiB
    DeviceFloats a(n), b(n), c(n), busy(size_t(64) << 20);  // busy: 256 MiB to write over and over
    cudaStream_t s = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    for (int i = 0; i < 4; ++i) {
      a.put(std::vector<float>(n, 3.0f));
      ASSERT_EQ(cudaMemset(b.p, 0, n * sizeof(float)), cudaSuccess);
      ASSERT_EQ(cudaMemset(c.p, 0, n * sizeof(float)), cudaSuccess);
      for (int k = 0; k < 40; ++k)  // about 10 GB of writes on the legacy stream: milliseconds on any GPU
        ASSERT_EQ(cudaMemsetAsync(busy.p, k, busy.n * sizeof(float), cudaStreamLegacy), cudaSuccess);
      WorkPtr w = pg.allreduce(a.buf(), b.buf());
      w->wait_on_stream(s);
      ASSERT_EQ(cudaMemcpyAsync(c.p, b.p, n * sizeof(float), cudaMemcpyDeviceToDevice, s), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
      EXPECT_TRUE(w->is_completed());
      const auto out = c.get();
      ASSERT_EQ(*std::min_element(out.begin(), out.end()), 3.0f) << "the copy ran before the allreduce, round " << i;
    }
    // Operations nobody waits on at all: the group stays usable.
    for (int i = 0; i < 50; ++i) (void)pg.allreduce(a.buf());
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // three watchdog rounds
    pg.barrier()->wait();
    EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
  });
}

TEST(NcclBackend, SubGroupAndBatchedSendRecv) {
  const int n = gpu_ranks();
  if (n < 2) GTEST_SKIP() << "needs 2 GPUs, " << n << " visible";
  run_gpu_ranks(n, [](ProcessGroup& pg) {
    const int me = pg.rank(), size = pg.size();
    DeviceFloats s(64), r(64);
    s.put(std::vector<float>(64, float(me)));
    pg.batch_isend_irecv({{P2POp::Send, s.buf(), (me + 1) % size}, {P2POp::Recv, r.buf(), (me - 1 + size) % size}})
        ->wait();
    for (float v : r.get()) ASSERT_EQ(v, float((me - 1 + size) % size));

    auto sub = pg.new_group({1, 0});  // rank order reversed: world rank 1 is the sub-group's rank 0
    if (me > 1) {
      EXPECT_EQ(sub, nullptr);
      return;
    }
    ASSERT_NE(sub, nullptr);
    EXPECT_EQ(sub->rank(), 1 - me);
    EXPECT_EQ(sub->backend_name(), "nccl");
    s.put(std::vector<float>(64, 1.0f));
    sub->allreduce(s.buf())->wait();
    for (float v : s.get()) ASSERT_EQ(v, 2.0f);
    sub->shutdown();
  });
}

#endif  // COHORT_HAVE_CUDA

}  // namespace
}  // namespace cohort
