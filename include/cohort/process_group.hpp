// cohort/process_group.hpp: the process group, its collectives and Work handles.
//
// A ProcessGroup is a fixed set of ranks that run collectives together. Every
// call returns a Work at once; the collective runs on the group's progress
// thread (or, when nothing is queued and the message is small, inline on the
// calling thread: see docs/algorithms.md), and calls on one group complete in
// the order they were issued. Issue a group's calls from one thread at a time.
//
// Buffers are not copied: keep them alive and untouched until the Work completes.
#pragma once

#include <chrono>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cohort/error.hpp"
#include "cohort/store.hpp"
#include "cohort/types.hpp"
#include "cohort/export.hpp"

namespace cohort {

// Handle to one asynchronous operation.
class COHORT_API Work {
 public:
  virtual ~Work() = default;
  virtual bool is_completed() const = 0;
  // Blocks until the operation completes and rethrows its error, if any. A
  // timeout of zero means the operation's own (its options' timeout, else the
  // group's). Throws TimeoutError if the operation has not completed in time;
  // the operation itself keeps its own deadline, so waiting again can succeed.
  virtual void wait(Millis timeout = Millis(0)) = 0;
  // Orders what is queued on `cuda_stream` (a cudaStream_t) after this
  // operation, as a CUDA-aware caller needs before it reads the result there.
  // Backends whose operations run on GPU streams (nccl) make that stream wait
  // on the GPU and return at once; their deadline is then enforced by the
  // group's watchdog thread, which fails and aborts the group when it passes,
  // and the failure surfaces at the group's next call. Others wait on the host,
  // as wait(timeout) does.
  virtual void wait_on_stream(void* cuda_stream, Millis timeout = Millis(0)) {
    (void)cuda_stream;
    wait(timeout);
  }
  // The error the operation failed with, or nullptr (also while still running).
  virtual std::exception_ptr error() const = 0;
  // A short description: "allreduce #12 (f32 x 1024, sum)".
  virtual std::string describe() const = 0;
};
using WorkPtr = std::shared_ptr<Work>;

// Per-call options. A timeout of zero means the group's (COHORT_TIMEOUT).
struct AllreduceOptions { ReduceOp op = ReduceOp::Sum; Millis timeout{0}; };
struct BroadcastOptions { int root = 0; Millis timeout{0}; };
struct ReduceOptions { ReduceOp op = ReduceOp::Sum; int root = 0; Millis timeout{0}; };
struct AllgatherOptions { Millis timeout{0}; };
struct ReduceScatterOptions { ReduceOp op = ReduceOp::Sum; Millis timeout{0}; };
struct GatherOptions { int root = 0; Millis timeout{0}; };
struct ScatterOptions { int root = 0; Millis timeout{0}; };
struct AlltoallOptions { Millis timeout{0}; };
struct BarrierOptions { Millis timeout{0}; };
struct SendRecvOptions { int tag = 0; Millis timeout{0}; };

// One send or receive of a batch_isend_irecv call.
struct COHORT_API P2POp {
  enum Kind { Send, Recv };
  Kind kind = Send;
  Buffer buf;
  int peer = -1;
  int tag = 0;
};

class COHORT_API ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "native", "mpi", ...
  virtual std::string backend_name() const = 0;
  // Ranks of this group in the world group, by group rank.
  virtual const std::vector<int>& world_ranks() const = 0;

  // Out-of-place: recv = op over ranks of send. send.count == recv.count.
  // In-place: pass the same buffer as send and recv.
  virtual WorkPtr allreduce(Buffer send, Buffer recv, AllreduceOptions opts = {}) = 0;
  WorkPtr allreduce(Buffer buf, AllreduceOptions opts = {}) { return allreduce(buf, buf, opts); }
  // In-place allreduce of `buf` whose input, for the elements each piece
  // names, is the piece's data rather than buf's (DDP: gradients still where
  // autograd put them, not yet copied into their bucket). Pieces lie inside
  // buf, do not overlap, and stay valid and unchanged until the Work completes;
  // the result is in buf. The default copies the pieces into buf and runs
  // allreduce(buf). A group reads in place the pieces inside the block this
  // rank reduces itself (allreduce_direct_block), which saves their copy.
  virtual WorkPtr allreduce_gathered(Buffer buf, std::vector<InputPiece> pieces, AllreduceOptions opts = {});
  // The elements [first, first + count) of an allreduce_gathered of `count`
  // elements of `dtype` that this rank reads straight from the pieces ({0, 0}:
  // none, every piece is copied into the buffer first). A caller that can
  // leave its data elsewhere should copy only what lies outside this block.
  virtual std::pair<size_t, size_t> allreduce_direct_block(size_t count, DType dtype) const;
  // Root's buf is copied into every rank's buf.
  virtual WorkPtr broadcast(Buffer buf, BroadcastOptions opts = {}) = 0;
  // recv (significant at root only, may be empty elsewhere) = op over ranks of send.
  virtual WorkPtr reduce(Buffer send, Buffer recv, ReduceOptions opts = {}) = 0;
  // recv.count == size() * send.count; rank r's send lands at recv[r * send.count].
  virtual WorkPtr allgather(Buffer send, Buffer recv, AllgatherOptions opts = {}) = 0;
  // send.count == size() * recv.count; rank r gets op over ranks of send[r * recv.count ...].
  virtual WorkPtr reduce_scatter(Buffer send, Buffer recv, ReduceScatterOptions opts = {}) = 0;
  // Many allgathers (reduce_scatters) in one collective, as PyTorch's
  // allgather_into_tensor_coalesced / reduce_scatter_tensor_coalesced: pair i
  // is what allgather(send[i], recv[i]) (reduce_scatter) would take, every
  // pair of one dtype. The default packs the inputs into one buffer from
  // allocate_buffer (shared memory on one host, where single copy runs), runs
  // one collective on it and unpacks into recv when the Work is waited on (or
  // first seen completed): read recv only after that. Throws InvalidArgument
  // for lists of different lengths, mixed dtypes or counts that do not fit,
  // naming the pair.
  virtual WorkPtr allgather_coalesced(std::vector<Buffer> send, std::vector<Buffer> recv, AllgatherOptions opts = {});
  virtual WorkPtr reduce_scatter_coalesced(std::vector<Buffer> send, std::vector<Buffer> recv,
                                           ReduceScatterOptions opts = {});
  // At root, recv.count == size() * send.count; elsewhere recv is ignored.
  virtual WorkPtr gather(Buffer send, Buffer recv, GatherOptions opts = {}) = 0;
  // At root, send.count == size() * recv.count; elsewhere send is ignored.
  virtual WorkPtr scatter(Buffer send, Buffer recv, ScatterOptions opts = {}) = 0;
  // send.count == recv.count == size() * k; block j of send goes to rank j,
  // block i of recv comes from rank i.
  virtual WorkPtr alltoall(Buffer send, Buffer recv, AlltoallOptions opts = {}) = 0;
  virtual WorkPtr barrier(BarrierOptions opts = {}) = 0;
  // Point to point. Messages between a pair with the same tag match in order;
  // the receiver's count must equal the sender's.
  virtual WorkPtr send(Buffer buf, int dst, SendRecvOptions opts = {}) = 0;
  virtual WorkPtr recv(Buffer buf, int src, SendRecvOptions opts = {}) = 0;
  // Runs every send and receive of the list together, like PyTorch's
  // batch_isend_irecv: none waits for another, so "everyone sends to the
  // right and receives from the left" cannot deadlock. A send or recv issued
  // alone completes only when the peer has taken the data (past the transport's
  // buffering), so pairs of large plain send/recv must be ordered (even ranks
  // send first) or batched with this call.
  virtual WorkPtr batch_isend_irecv(const std::vector<P2POp>& ops, Millis timeout = Millis(0)) = 0;

  // A sub-group of the ranks listed (group ranks of this group, any order gives
  // the new group's rank order). Every rank of this group must call it with the
  // same list, in the same order relative to its other new_group calls. Returns
  // nullptr on ranks that are not in `ranks`.
  virtual std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks) = 0;

  // Memory for a buffer this group will reduce many times (DDP's gradient
  // buckets): `bytes`, zeroed, 64-byte aligned, freed with the last copy of the
  // pointer. On a native group whose ranks share a host (single copy on), it
  // is shared memory that peers map once, so large allreduces on it load and
  // store the peers' bytes directly instead of copying them through the
  // kernel; elsewhere it is ordinary memory. Every collective takes any
  // buffer: this one only makes them cheaper. (COHORT_SHARED_BUFFERS=0: always
  // ordinary memory.)
  virtual std::shared_ptr<std::byte[]> allocate_buffer(size_t bytes);

  // The CUDA device whose memory this group's collectives move, or -1 when
  // they move host memory (native, mpi). The nccl backend takes GPU memory of
  // that device only (GPU LOCAL_RANK modulo the visible GPUs): small host data (a flag, a string) goes through a buffer
  // there (cohort::torch does it for its helpers, ddp::Reducer for its own).
  virtual int cuda_device() const { return -1; }

  // A group of the same ranks, in the same order, whose collectives move host
  // memory: for small exchanges on the host (checkpoints agreeing on their
  // files, a mesh comparing shapes) beside a group that moves GPU memory
  // only, as PyTorch programs keep a gloo group beside nccl. Native and mpi:
  // this group itself. nccl: a native group over the same store and
  // transports, made by the first call (collective, like new_group: every
  // rank calls it at the same point) and shut down with this group.
  virtual ProcessGroup& host_group() { return *this; }

  // Ends the group: later calls throw. The native backend stops its progress
  // thread and fails queued Work ("... was cancelled: the group was shut
  // down"); its connections stay open until the last reference to the group
  // goes (DDP and sub-groups may still hold one). The MPI and NCCL backends let
  // enqueued operations finish, then free their communicators.
  virtual void shutdown() = 0;
};

// The CUDA stream (a cudaStream_t) that GPU collectives issued from this
// thread are ordered after, while the scope lives: the nccl backend's stream
// waits, on the device, for the work already queued there, so a collective
// reads what kernels launched before it wrote. Outside any scope that is the
// legacy default stream. cohort::torch sets LibTorch's current stream here
// around the collectives DistributedDataParallel issues. Scopes nest; the
// pointer is only stored, never dereferenced, so this needs no CUDA.
class [[nodiscard]] COHORT_API CudaStreamScope {
 public:
  explicit CudaStreamScope(void* cuda_stream);
  ~CudaStreamScope();
  CudaStreamScope(const CudaStreamScope&) = delete;
  CudaStreamScope& operator=(const CudaStreamScope&) = delete;
  // The innermost scope's stream on this thread; nullptr: none (legacy default stream).
  static void* current();

 private:
  void* previous_;
};

struct COHORT_API InitOptions {
  std::string backend = "native";  // or COHORT_BACKEND
  // Unset fields come from the environment (RANK, WORLD_SIZE, LOCAL_RANK,
  // LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; the launcher's COHORT_STORE_*;
  // or mpirun's, mpiexec's or srun's variables: docs/clusters.md).
  std::optional<int> rank;
  std::optional<int> world_size;
  std::shared_ptr<Store> store;    // given: used as is (tests run ranks as threads)
  Millis timeout{0};               // 0: COHORT_TIMEOUT
  std::string transport;           // "" (auto), "shm", "tcp"; or COHORT_TRANSPORT
};

// Builds the world group. With no store given, it connects to the launcher's
// store (COHORT_STORE_ADDR/PORT) or, started without the launcher, to the one
// rank 0 serves at MASTER_ADDR:MASTER_PORT. Under mpirun, mpiexec or srun
// (no torchrun variables) rank and size come from their variables, and the
// store's host from MASTER_ADDR, this host (all ranks local) or the first node
// of the Slurm node list; InvalidArgument says what to set when none applies.
COHORT_API std::shared_ptr<ProcessGroup> init_process_group(InitOptions opts = {});

// The cohort library's version, "major.minor.patch".
COHORT_API const char* version();

}  // namespace cohort
