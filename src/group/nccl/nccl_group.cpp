// NcclGroup: the ProcessGroup of the NCCL backend, and its factory.
//
// Each call checks its arguments (group/op.hpp validate, then that every
// buffer it reads or writes is GPU memory of this rank's device), numbers the
// operation and enqueues it on the communicator's stream (NcclComm::issue);
// the returned Work completes when the stream has run it.
//
// NCCL has allreduce, broadcast, reduce, allgather and reduce_scatter. The
// others are grouped point-to-point calls, so that they run on every NCCL
// from 2.18 on:
//   gather:   every rank but the root ncclSends its block to the root; the root
//             ncclRecvs block r from rank r and copies its own block itself.
//   scatter:  the mirror image (the root sends block r to rank r).
//   alltoall: every rank sends block j of send to rank j and receives block i
//             of recv from rank i, all in one ncclGroupStart/End; its own
//             block is a device-to-device copy. In place, send is first copied
//             to a scratch buffer (stream-ordered allocation), since a receive
//             would otherwise overwrite a block not yet sent.
//   barrier:  an allreduce of one float on the stream; its Work's wait is the sync.
//   send/recv and batch_isend_irecv: ncclSend/ncclRecv, grouped for a batch.
//     NCCL has no tags: messages between a pair match in issue order, whatever their tag.
#include "group/nccl/nccl_group.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <set>

#include "core/log.hpp"
#include "group/native_group.hpp"
#include "group/nccl/nccl_comm.hpp"

namespace cohort::group {

bool nccl_backend_built() {
  return true;
}

namespace nccl {
namespace {

using collectives::Coll;

// Returns from the enclosing enqueue function when an NCCL call fails.
#define COHORT_NCCL_TRY(call)                                                      \
  do {                                                                             \
    ncclResult_t cohort_r_ = (call);                                               \
    if (cohort_r_ != ncclSuccess && cohort_r_ != ncclInProgress) return cohort_r_; \
  } while (0)

// Runs calls() inside ncclGroupStart/End. The group is closed even when a
// call inside fails, and the first failure is returned.
template <class F>
ncclResult_t grouped(F calls) {
  ncclResult_t r = ncclGroupStart();
  if (r != ncclSuccess) return r;
  ncclResult_t inner = calls();
  ncclResult_t end = ncclGroupEnd();
  return inner != ncclSuccess && inner != ncclInProgress ? inner : end;
}

ncclResult_t copy_on(cudaStream_t s, void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src) return ncclSuccess;
  if (cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s) != cudaSuccess) return ncclUnhandledCudaError;
  return ncclSuccess;
}

uint8_t* at(void* p, size_t block, size_t bytes) {
  return static_cast<uint8_t*>(p) + block * bytes;
}

class NcclGroup final : public ProcessGroup {
 public:
  explicit NcclGroup(std::shared_ptr<NcclComm> comm) : comm_(std::move(comm)) {
    DeviceGuard g(comm_->device());
    check_cuda(cudaMalloc(&barrier_buf_, sizeof(float)), "cudaMalloc of the barrier's one float");
    check_cuda(cudaMemset(barrier_buf_, 0, sizeof(float)), "cudaMemset of the barrier's one float");
  }
  ~NcclGroup() override { shutdown(); }

  int rank() const override { return comm_->setup().rank; }
  int size() const override { return comm_->setup().size; }
  std::string backend_name() const override { return "nccl"; }
  int cuda_device() const override { return comm_->device(); }
  const std::vector<int>& world_ranks() const override { return comm_->setup().world_ranks; }

  WorkPtr allreduce(Buffer send, Buffer recv, AllreduceOptions o) override {
    OpDesc d{Coll::Allreduce, send, recv, o.op, 0, -1, 0, o.timeout};
    return run(d, {{&d.send, "send"}, {&d.recv, "recv"}}, [d](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(d.send.data, d.recv.data, d.send.count, to_nccl(d.send.dtype), to_nccl(d.op), c, s);
    });
  }
  WorkPtr broadcast(Buffer buf, BroadcastOptions o) override {
    OpDesc d{Coll::Broadcast, buf, buf, ReduceOp::Sum, o.root, -1, 0, o.timeout};
    return run(d, {{&d.recv, "buf"}}, [d](ncclComm_t c, cudaStream_t s) {
      return ncclBroadcast(d.recv.data, d.recv.data, d.recv.count, to_nccl(d.recv.dtype), d.root, c, s);
    });
  }
  WorkPtr reduce(Buffer send, Buffer recv, ReduceOptions o) override {
    OpDesc d{Coll::Reduce, send, recv, o.op, o.root, -1, 0, o.timeout};
    const bool root = rank() == o.root;
    if (!root) d.recv = Buffer{nullptr, 0, send.dtype};  // NCCL: recvbuff may be NULL except at the root
    return run(d, {{&d.send, "send"}, {&d.recv, "recv"}}, [d](ncclComm_t c, cudaStream_t s) {
      return ncclReduce(d.send.data, d.recv.data, d.send.count, to_nccl(d.send.dtype), to_nccl(d.op), d.root, c, s);
    });
  }
  WorkPtr allgather(Buffer send, Buffer recv, AllgatherOptions o) override {
    OpDesc d{Coll::Allgather, send, recv, ReduceOp::Sum, 0, -1, 0, o.timeout};
    return run(d, {{&d.send, "send"}, {&d.recv, "recv"}}, [d](ncclComm_t c, cudaStream_t s) {
      return ncclAllGather(d.send.data, d.recv.data, d.send.count, to_nccl(d.send.dtype), c, s);
    });
  }
  WorkPtr reduce_scatter(Buffer send, Buffer recv, ReduceScatterOptions o) override {
    OpDesc d{Coll::ReduceScatter, send, recv, o.op, 0, -1, 0, o.timeout};
    return run(d, {{&d.send, "send"}, {&d.recv, "recv"}}, [d](ncclComm_t c, cudaStream_t s) {
      return ncclReduceScatter(d.send.data, d.recv.data, d.recv.count, to_nccl(d.send.dtype), to_nccl(d.op), c, s);
    });
  }
  WorkPtr gather(Buffer send, Buffer recv, GatherOptions o) override {
    OpDesc d{Coll::Gather, send, recv, ReduceOp::Sum, o.root, -1, 0, o.timeout};
    const int me = rank(), n = size();
    if (me != o.root) d.recv = Buffer{nullptr, 0, send.dtype};
    return run(d, {{&d.send, "send"}, {&d.recv, "recv"}}, [d, me, n](ncclComm_t c, cudaStream_t s) {
      const size_t b = d.send.bytes();
      const ncclDataType_t t = to_nccl(d.send.dtype);
      if (me != d.root) return ncclSend(d.send.data, d.send.count, t, d.root, c, s);
      COHORT_NCCL_TRY(copy_on(s, at(d.recv.data, me, b), d.send.data, b));
      return grouped([&] {
        for (int r = 0; r < n; ++r)
          if (r != me) COHORT_NCCL_TRY(ncclRecv(at(d.recv.data, r, b), d.send.count, t, r, c, s));
        return ncclSuccess;
      });
    });
  }
  WorkPtr scatter(Buffer send, Buffer recv, ScatterOptions o) override {
    OpDesc d{Coll::Scatter, send, recv, ReduceOp::Sum, o.root, -1, 0, o.timeout};
    const int me = rank(), n = size();
    if (me != o.root) d.send = Buffer{nullptr, 0, recv.dtype};
    return run(d, {{&d.send, "send"}, {&d.recv, "recv"}}, [d, me, n](ncclComm_t c, cudaStream_t s) {
      const size_t b = d.recv.bytes();
      const ncclDataType_t t = to_nccl(d.recv.dtype);
      if (me != d.root) return ncclRecv(d.recv.data, d.recv.count, t, d.root, c, s);
      COHORT_NCCL_TRY(copy_on(s, d.recv.data, at(d.send.data, me, b), b));
      return grouped([&] {
        for (int r = 0; r < n; ++r)
          if (r != me) COHORT_NCCL_TRY(ncclSend(at(d.send.data, r, b), d.recv.count, t, r, c, s));
        return ncclSuccess;
      });
    });
  }
  WorkPtr alltoall(Buffer send, Buffer recv, AlltoallOptions o) override {
    OpDesc d{Coll::Alltoall, send, recv, ReduceOp::Sum, 0, -1, 0, o.timeout};
    const int me = rank(), n = size();
    return run(d, {{&d.send, "send"}, {&d.recv, "recv"}}, [this, d, me, n](ncclComm_t c, cudaStream_t s) {
      const size_t k = d.send.count / n, b = k * dtype_size(d.send.dtype);
      const ncclDataType_t t = to_nccl(d.send.dtype);
      const void* src = d.send.data;
      if (d.send.data == d.recv.data) {
        COHORT_NCCL_TRY(scratch(s, d.send.bytes()));
        COHORT_NCCL_TRY(copy_on(s, scratch_, d.send.data, d.send.bytes()));
        src = scratch_;
      }
      COHORT_NCCL_TRY(copy_on(s, at(d.recv.data, me, b), at(const_cast<void*>(src), me, b), b));
      return grouped([&] {
        for (int r = 0; r < n; ++r) {
          if (r == me) continue;
          COHORT_NCCL_TRY(ncclSend(at(const_cast<void*>(src), r, b), k, t, r, c, s));
          COHORT_NCCL_TRY(ncclRecv(at(d.recv.data, r, b), k, t, r, c, s));
        }
        return ncclSuccess;
      });
    });
  }
  WorkPtr barrier(BarrierOptions o) override {
    OpDesc d{Coll::Barrier, {}, {}, ReduceOp::Sum, 0, -1, 0, o.timeout};
    void* buf = barrier_buf_;
    return run(d, {},
               [buf](ncclComm_t c, cudaStream_t s) { return ncclAllReduce(buf, buf, 1, ncclFloat32, ncclSum, c, s); });
  }
  WorkPtr send(Buffer buf, int dst, SendRecvOptions o) override {
    OpDesc d{Coll::Send, buf, {}, ReduceOp::Sum, 0, dst, o.tag, o.timeout};
    return run(d, {{&d.send, "send"}}, [d](ncclComm_t c, cudaStream_t s) {
      return ncclSend(d.send.data, d.send.count, to_nccl(d.send.dtype), d.peer, c, s);
    });
  }
  WorkPtr recv(Buffer buf, int src, SendRecvOptions o) override {
    OpDesc d{Coll::Recv, {}, buf, ReduceOp::Sum, 0, src, o.tag, o.timeout};
    return run(d, {{&d.recv, "recv"}}, [d](ncclComm_t c, cudaStream_t s) {
      return ncclRecv(d.recv.data, d.recv.count, to_nccl(d.recv.dtype), d.peer, c, s);
    });
  }
  WorkPtr batch_isend_irecv(const std::vector<P2POp>& ops, Millis timeout) override {
    OpDesc d{Coll::P2PBatch};
    d.timeout = timeout;
    d.batch = ops;
    std::vector<std::pair<const Buffer*, const char*>> bufs;
    for (const auto& op : d.batch) bufs.emplace_back(&op.buf, op.kind == P2POp::Send ? "send" : "recv");
    return run(d, bufs, [d](ncclComm_t c, cudaStream_t s) {
      return grouped([&] {
        for (const auto& op : d.batch) {
          if (op.buf.count == 0) continue;
          if (op.kind == P2POp::Send)
            COHORT_NCCL_TRY(ncclSend(op.buf.data, op.buf.count, to_nccl(op.buf.dtype), op.peer, c, s));
          else
            COHORT_NCCL_TRY(ncclRecv(op.buf.data, op.buf.count, to_nccl(op.buf.dtype), op.peer, c, s));
        }
        return ncclSuccess;
      });
    });
  }

  std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks) override {
    const GroupSetup& me = comm_->setup();
    std::set<int> seen;
    for (int r : ranks) {
      if (r < 0 || r >= me.size)
        throw InvalidArgument(
            fmt::format("new_group: rank {} is out of range; this group has ranks 0..{}", r, me.size - 1));
      if (!seen.insert(r).second) throw InvalidArgument(fmt::format("new_group: rank {} is listed twice", r));
    }
    if (ranks.empty()) throw InvalidArgument("new_group: the list of ranks is empty");
    // Every rank counts new_group calls, members or not, so that the ids
    // agree; every rank also takes part in ncclCommSplit (the non-members with
    // NCCL_SPLIT_NOCOLOR), which NCCL requires of all ranks of the parent.
    GroupSetup s = me;
    s.group_id = fmt::format("{}.{}", me.group_id, ++subgroups_);
    auto it = std::find(ranks.begin(), ranks.end(), me.rank);
    const bool member = it != ranks.end();
    s.rank = member ? static_cast<int>(it - ranks.begin()) : 0;
    s.size = static_cast<int>(ranks.size());
    s.world_ranks.clear();
    for (int r : ranks) s.world_ranks.push_back(me.world_ranks[r]);
    s.store = std::make_shared<PrefixStore>("g" + s.group_id, me.root_store);
    s.store->set_timeout(me.timeout);
    auto child = comm_->split(s, member, s.rank);
    if (!member) return nullptr;
    return std::make_shared<NcclGroup>(std::move(child));
  }

  ProcessGroup& host_group() override {
    std::lock_guard<std::mutex> g(host_mu_);
    if (!host_) {
      if (comm_->is_shut_down()) throw Error("host_group: the nccl group was shut down");
      const GroupSetup& me = comm_->setup();
      GroupSetup s = me;
      s.group_id = fmt::format("{}.host", me.group_id);
      s.store = std::make_shared<PrefixStore>("g" + s.group_id, me.root_store);
      s.store->set_timeout(me.timeout);
      host_ = NativeGroup::create(std::move(s));
    }
    return *host_;
  }

  // Also called by the destructor: never throws.
  void shutdown() override {
    {
      std::lock_guard<std::mutex> g(host_mu_);
      if (host_) host_->shutdown();
    }
    if (comm_->is_shut_down() && barrier_buf_ == nullptr) return;
    comm_->shutdown();  // drains the stream (or aborts) first, so the buffers below are idle
    try {
      DeviceGuard g(comm_->device());
      if (barrier_buf_ != nullptr) (void)cudaFree(barrier_buf_);
      // Stream-ordered memory goes back the stream-ordered way; the stream has drained (or was aborted) above.
      if (scratch_ != nullptr) (void)cudaFreeAsync(scratch_, cudaStreamLegacy);
    } catch (const std::exception& e) {
      COHORT_WARN(kColl, "NCCL group shutdown: {}", e.what());
    }
    barrier_buf_ = scratch_ = nullptr;
  }

 private:
  using Enqueue = std::function<ncclResult_t(ncclComm_t, cudaStream_t)>;

  WorkPtr run(OpDesc& d, const std::vector<std::pair<const Buffer*, const char*>>& bufs, Enqueue enqueue) {
    const GroupSetup& me = comm_->setup();
    validate(d, me.rank, me.size);
    const std::string name = fmt::format("rank {}: {}", me.rank, collectives::coll_name(d.coll));
    for (const auto& [b, which] : bufs) check_device_buffer(*b, comm_->device(), name.c_str(), which);
    const bool empty = d.coll != Coll::Barrier && d.coll != Coll::P2PBatch && d.call_count() == 0;
    if (empty) enqueue = [](ncclComm_t, cudaStream_t) { return ncclSuccess; };  // same count on every rank: all skip
    return comm_->issue(d, enqueue);
  }

  // Grows the in-place alltoall's scratch buffer, in stream order: the old one
  // is freed after the operations already enqueued that use it.
  ncclResult_t scratch(cudaStream_t s, size_t bytes) {
    if (bytes <= scratch_bytes_) return ncclSuccess;
    if (scratch_ != nullptr && cudaFreeAsync(scratch_, s) != cudaSuccess) return ncclUnhandledCudaError;
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    if (cudaMallocAsync(&scratch_, bytes, s) != cudaSuccess) return ncclUnhandledCudaError;
    scratch_bytes_ = bytes;
    return ncclSuccess;
  }

  std::shared_ptr<NcclComm> comm_;
  std::mutex host_mu_;
  std::shared_ptr<ProcessGroup> host_;  // host_group(), once made
  void* barrier_buf_ = nullptr;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  int subgroups_ = 0;
};

}  // namespace
}  // namespace nccl

std::shared_ptr<ProcessGroup> create_nccl_group(const GroupSetup& setup, std::optional<int> local_rank) {
  int devices = 0;
  cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices <= 0) {
    (void)cudaGetLastError();
    std::string seen = e != cudaSuccess ? "cudaGetDeviceCount failed: " + nccl::cuda_error_text(e)
                                        : std::string("no CUDA device is visible (cudaGetDeviceCount returned 0)");
    std::string why = fmt::format("rank {}: backend 'nccl' needs a CUDA GPU, but {}", setup.rank, seen);
    try {  // let the other ranks fail fast instead of waiting for us at set-up
      setup.store->compare_set("failure", Bytes{}, Bytes(why.begin(), why.end()));
    } catch (const std::exception&) {
    }
    throw InvalidArgument(
        fmt::format("{}; HINT: run on a machine with an NVIDIA GPU and driver (nvidia-smi lists it), "
                    "check CUDA_VISIBLE_DEVICES, or use COHORT_BACKEND=native with host buffers",
                    why));
  }
  // One GPU per rank: NCCL refuses two ranks of a communicator on one GPU
  // ("Duplicate GPU detected"), so say it here, with the fix, before it does.
  // Only where every process of the node sees the same GPUs (no
  // CUDA_VISIBLE_DEVICES): a scheduler that gives each process its own GPU
  // shows each one GPU, and local rank 1 on its "GPU 0" is another GPU.
  if (local_rank && *local_rank >= devices && std::getenv("CUDA_VISIBLE_DEVICES") == nullptr) {
    std::string why = fmt::format(
        "rank {}: backend 'nccl' runs one process per GPU, but this is local rank {} and only {} GPU{} visible "
        "here, so two ranks would share one GPU",
        setup.rank, *local_rank, devices, devices == 1 ? " is" : "s are");
    try {
      setup.store->compare_set("failure", Bytes{}, Bytes(why.begin(), why.end()));
    } catch (const std::exception&) {
    }
    throw InvalidArgument(fmt::format("{}; HINT: start at most {} rank{} per node (--nproc-per-node {}), or use "
                                      "COHORT_BACKEND=native, which stages GPU tensors through host memory and lets "
                                      "ranks share a GPU",
                                      why, devices, devices == 1 ? "" : "s", devices));
  }
  const int device = (local_rank ? *local_rank : setup.rank) % devices;
  // The caller's thread works on this rank's GPU from now on, as with
  // torch.cuda.set_device(LOCAL_RANK): its cudaMalloc'd buffers land there.
  nccl::check_cuda(cudaSetDevice(device), fmt::format("rank {}: cudaSetDevice({})", setup.rank, device));
  COHORT_INFO(kInit, "rank {}: NCCL backend on GPU {} of {} visible", setup.rank, device, devices);
  return std::make_shared<nccl::NcclGroup>(nccl::NcclComm::init(setup, device));
}

}  // namespace cohort::group
