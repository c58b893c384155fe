// cohort/ddp.hpp: the framework-neutral gradient reducer of DistributedDataParallel.
//
// A Reducer averages gradients across the ranks of a group while backward is
// still running. A framework adapter (src/torch for LibTorch) registers the
// parameters once, tells the reducer from its autograd hooks that a
// parameter's gradient is ready, and calls finalize() at the end of backward.
// Gradients are packed into buckets (plan_buckets); a bucket's communication
// starts as soon as all of its gradients are ready, so it overlaps the rest of
// backward. docs/ddp.md has the whole story; the calls, per iteration:
//
//   forward:            reducer.prepare_for_backward();      // optional, see below
//   backward, hook i:   reducer.mark_ready(i, grad_i);        // any order, any thread
//   after backward:     reducer.finalize();                   // before optimizer.step()
//   accumulate locally: { auto guard = reducer.no_sync(); ... backward ... }
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cohort/checkpoint.hpp"
#include "cohort/process_group.hpp"
#include "cohort/types.hpp"
#include "cohort/export.hpp"

namespace cohort::ddp {

// One parameter as the adapter registers it. All ranks register the same
// parameters (same counts and dtypes) in the same order.
struct COHORT_API ParamSpec {
  std::string name;          // for error messages: "fc2.weight"
  size_t count = 0;          // elements (zero-size parameters are allowed)
  DType dtype = DType::F32;
  // The parameter's gradient storage (its .grad), or nullptr while it has
  // none. finalize() writes the averaged gradient here (without
  // gradient_as_bucket_view or on_reduced), and a parameter never marked
  // ready contributes what is here (zeros if nullptr) under
  // find_unused_parameters. Change it with Reducer::set_grad.
  void* grad = nullptr;
  // The first dimension of the parameter's shape (a comm hook that treats a
  // gradient as a matrix, as PowerSGD does, views it as rows x count / rows);
  // 0: unknown, taken as count (a column).
  size_t rows = 0;
};

// ---- Bucket plan (a pure function) ----

struct COHORT_API BucketPlanOptions {
  size_t cap_bytes = size_t(25) << 20;       // bucket_cap_mb
  size_t first_cap_bytes = size_t(1) << 20;  // the first bucket (PyTorch's _DEFAULT_FIRST_BUCKET_BYTES)
  // Every bucket's count is rounded up to a multiple of this (zero elements
  // of padding at its end): ZeRO passes the world size, so that each rank
  // owns an equal chunk of every bucket. 0 is taken as 1.
  size_t count_multiple = 1;
};

struct COHORT_API PlannedBucket {
  DType dtype = DType::F32;
  size_t count = 0;             // elements in the flat buffer (with the padding of count_multiple)
  std::vector<size_t> params;   // registration indices, in bucket order (descending: reverse registration order)
  std::vector<size_t> offsets;  // offsets[k]: element offset of params[k] in the flat buffer

  size_t bytes() const { return count * dtype_size(dtype); }
};
using BucketPlan = std::vector<PlannedBucket>;

// Packs the parameters, in REVERSE registration order (roughly the order in
// which backward produces their gradients), greedily into buckets, one open
// bucket per dtype (as PyTorch): a bucket is closed when the next parameter of
// its dtype would take it past its cap (first_cap_bytes for the first bucket
// of a dtype, cap_bytes after) or when it reaches its cap. A parameter larger
// than the cap sits alone in its bucket; zero-size parameters join their
// dtype's bucket (they take no space). Buckets are listed in the order they
// complete during that walk. Throws InvalidArgument for an invalid dtype.
COHORT_API BucketPlan plan_buckets(std::span<const ParamSpec> params, const BucketPlanOptions& opts = {});

// ---- Where gradients and buckets live ----

// How the reducer allocates its buckets and moves gradient bytes. The default
// (ReducerOptions::memory left null) is host memory: buckets from
// ProcessGroup::allocate_buffer, copies with memcpy. The LibTorch adapter
// gives a module on a GPU its own (src/torch/grad_memory.cpp): on a group
// that moves GPU memory (nccl) the buckets are device memory and every copy or
// conversion is queued on LibTorch's current stream; on a host group (native)
// the buckets stay in host memory and each gradient is staged through it.
// Called under the reducer's lock, on the thread of mark_ready or finalize.
class COHORT_API GradMemory {
 public:
  virtual ~GradMemory() = default;
  // Whether the reducer (and the group) may read bucket memory, and gradient
  // memory, as host memory.
  virtual bool buckets_on_host() const = 0;
  virtual bool grads_on_host() const = 0;
  // `bytes` of zeroed bucket memory, 64-byte aligned, freed with the last copy.
  virtual std::shared_ptr<std::byte[]> allocate(ProcessGroup& group, size_t bytes) = 0;
  virtual void grad_to_bucket(void* bucket, const void* grad, size_t bytes) = 0;
  virtual void bucket_to_grad(void* grad, const void* bucket, size_t bytes) = 0;
  // Several copies handed over at once (none of them overlap). With
  // grads_valid_until_finalize and buckets outside host memory, the reducer
  // gives a bucket's gradients in one call when it launches the bucket, and
  // every result in one call at the end of finalize(). The defaults call
  // grad_to_bucket and bucket_to_grad for each; a GPU memory queues them as
  // one kernel, because there a small model's step waits for the host's
  // cost per copy, not for the bytes.
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
    // copy_queue() when the copy was asked for (0 for the results): a GPU
    // memory reads each gradient on the stream that wrote it.
    uint64_t queue = 0;
  };
  virtual void grads_to_buckets(std::span<const Copy> copies);
  virtual void buckets_to_grads(std::span<const Copy> copies);
  // Where this memory's operations are queued now, as a token (a GPU memory:
  // LibTorch's current stream); 0 where there is no such queue.
  virtual uint64_t copy_queue() { return 0; }
  virtual void zero_bucket(void* bucket, size_t bytes) = 0;
  // Waits for a bucket's collective before its result is used (finalize):
  // on the host here; GPU memory makes the stream that uses the gradients
  // wait instead (Work::wait_on_stream), so that backward returns without
  // draining the GPU.
  virtual void wait(Work& work, Millis timeout) { work.wait(timeout); }
  // Used only when buckets_on_host() is false (host buckets are converted
  // and read by the reducer and the hooks themselves); the defaults throw.
  // Within bucket memory: dst[i] = src[i] / divisor, converted to dst's dtype
  // (dst may be src when their dtypes match; floating-point types). The compression hooks' work.
  virtual void convert(Buffer dst, Buffer src, double divisor);
  // Small control data (the construction check, the used-parameter map)
  // between bucket memory and the host; returns when the copy is done.
  virtual void host_to_bucket(void* bucket, const void* host, size_t bytes);
  virtual void bucket_to_host(void* host, const void* bucket, size_t bytes);
};

// Host memory, as described above (what a null ReducerOptions::memory means).
COHORT_API std::shared_ptr<GradMemory> host_grad_memory();

// Memory a comm hook may use for one bucket (GradBucket::scratch).
struct COHORT_API BucketScratch {
  std::shared_ptr<std::byte[]> data;
  size_t bytes = 0;
};

// ---- Communication hooks ----

// What a comm hook is given: one bucket whose gradients are all ready.
class COHORT_API GradBucket {
 public:
  // `pieces`: gradients the reducer left outside the buffer (see
  // ReducerOptions::grads_valid_until_finalize), sorted by offset, or nullptr.
  // `offsets`, `counts` and `rows`, when given, are each parameter's element
  // offset in the buffer, its ParamSpec::count and its ParamSpec::rows, in
  // bucket order.
  GradBucket(size_t index, size_t num_buckets, Buffer buffer, ProcessGroup& group, Millis timeout,
             std::span<const size_t> params, GradMemory& memory, BucketScratch& scratch,
             std::vector<InputPiece>* pieces = nullptr, std::span<const size_t> offsets = {},
             std::span<const size_t> counts = {}, std::span<const size_t> rows = {})
      : index_(index), num_buckets_(num_buckets), buffer_(buffer), group_(group), timeout_(timeout),
        params_(params), memory_(memory), scratch_(scratch), pieces_(pieces), offsets_(offsets), counts_(counts),
        rows_(rows) {}

  size_t index() const { return index_; }  // position in the plan = launch order
  // The last bucket the hook is given this iteration (the reducer skips
  // buckets without elements, so it passes as num_buckets the position after
  // the last bucket that has some): where a hook ends its iteration.
  bool is_last() const { return index_ + 1 == num_buckets_; }
  // The bucket's flat gradients, all of them (gradients the reducer had left
  // where they were are copied in at the first call). The hook leaves the
  // result here (in place).
  Buffer buffer() const;
  // Starts the in-place allreduce of the bucket, like
  // group().allreduce(buffer(), opts), except that the group reads gradients
  // still outside the buffer where they are when it can (one copy fewer).
  WorkPtr allreduce(AllreduceOptions opts) const;
  ProcessGroup& group() const { return group_; }
  // The reducer's timeout option (zero: the group's); pass it to collectives.
  Millis timeout() const { return timeout_; }
  // Registration indices of the bucket's parameters, in bucket order.
  std::span<const size_t> params() const { return params_; }
  // Each parameter's element offset in buffer(), its element count and its
  // ParamSpec::rows, in bucket order (empty when the bucket was made without
  // them). The buffer may end in padding that no parameter owns.
  std::span<const size_t> offsets() const { return offsets_; }
  std::span<const size_t> counts() const { return counts_; }
  std::span<const size_t> rows() const { return rows_; }
  // Where the bucket lives (host or device memory) and how to convert in it.
  GradMemory& memory() const { return memory_; }
  // At least `bytes` of bucket memory (memory()) owned by the reducer for this
  // bucket, reused across iterations and kept alive as long as the reducer (so
  // a collective on it may safely outlive a failed finalize). Aligned to 64 bytes.
  void* scratch(size_t bytes);

 private:
  size_t index_, num_buckets_;
  Buffer buffer_;
  ProcessGroup& group_;
  Millis timeout_;
  std::span<const size_t> params_;
  GradMemory& memory_;
  BucketScratch& scratch_;
  std::vector<InputPiece>* pieces_;
  std::span<const size_t> offsets_, counts_, rows_;
};

// A hook's answer: the communication it started and what to do once it is done.
struct COHORT_API CommFuture {
  WorkPtr work;                // nullptr: nothing to wait for
  // Runs in finalize(), on its thread (with ReducerOptions::recycled_buckets
  // possibly earlier, in a mark_ready() that needs the bucket's memory),
  // after GradMemory::wait(work): on the
  // host, work has completed without error; with GPU memory that orders a
  // stream instead (DDP's wait_on_stream), work may still be running, and
  // `then` must only queue work on the current stream (the compression hooks
  // convert there). E.g. decompress the scratch result into the bucket's
  // buffer. May be empty.
  std::function<void()> then;
  // The next step of a hook that runs several collectives in sequence, each
  // needing the result of the one before (int8_compress_hook: an alltoall of
  // the quantised chunks, then an allgather of the reduced ones). finalize()
  // calls it once `work` has completed, instead of `then`, and handles the
  // future it returns alike (its own then, its own next). It runs one step of
  // every bucket per round, in bucket order, so every rank issues the steps'
  // collectives in the same order. Host buckets only (GradMemory::wait must
  // have completed the work). May be empty.
  std::function<CommFuture()> next;
};

// Like PyTorch's register_comm_hook. Called once per bucket per synced
// iteration, in plan order, on the thread of the mark_ready() or finalize()
// that completed the bucket, with the reducer's lock held (do not call back
// into the reducer). It must start its collectives without waiting for them
// and issue the same collectives on every rank. Anything it captures by
// pointer must outlive the CommFuture (use GradBucket::scratch for buffers).
using CommHook = std::function<CommFuture(GradBucket&)>;

// The default: allreduce with ReduceOp::Avg, in place.
COHORT_API CommHook allreduce_avg_hook();
// Convert the bucket to f16 (bf16) into scratch, allreduce-sum that, and in
// finalize convert back dividing by the group size. For f32, f64, f16 and
// bf16 buckets (an integer bucket throws InvalidArgument). The sum is formed in
// the compressed type: it must fit (f16's largest finite value is 65504).
COHORT_API CommHook fp16_compress_hook();
COHORT_API CommHook bf16_compress_hook();
// 8-bit quantisation with error feedback, for f32 host buckets: a quarter of
// the plain allreduce's bytes (docs/ddp.md, "Compression"). Each rank adds its
// error of the last step to the gradient, cuts the bucket into one chunk per
// rank, scales each chunk to int8 (scale = max |x| / 127, rounding to the
// nearest step, so no element moves by more than half a step) and keeps what
// rounding lost; an alltoall sends chunk j to rank j, which averages the n
// dequantised copies, adds its own error of the last step, quantises the
// average again and allgathers it. The hook keeps both errors per bucket
// (one hook per reducer: each call of this function makes a fresh state).
COHORT_API CommHook int8_compress_hook();

// PowerSGD (Vogels et al. 2019, "PowerSGD: Practical Low-Rank Gradient
// Compression for Distributed Optimization"), as PyTorch's powerSGD_hook:
// each gradient of a bucket viewed as a matrix M (ParamSpec::rows x the rest)
// is sent as two thin matrices, P = M Q and Q = M^T P, of `rank` columns;
// the others (biases, matrices too small to gain min_compression_rate) are
// averaged as they are. docs/ddp.md, "Compression".
struct COHORT_API PowerSgdOptions {
  int rank = 1;                      // PyTorch's matrix_approximation_rank
  int64_t start_iter = 1000;         // plain averaging for the first iterations (start_powerSGD_iter)
  double min_compression_rate = 2;   // compress M (n x m) only if (n + m) rank * this < n m
  bool error_feedback = true;        // add what compression lost to the next iteration's gradient
  bool warm_start = true;            // start from the last iteration's Q
  float orthogonalization_epsilon = 0;
  uint64_t seed = 0;                 // the random first Q (the same on every rank)
};

// The hook's state, shared by its calls: make one per reducer.
class COHORT_API PowerSgdState {
 public:
  explicit PowerSgdState(PowerSgdOptions opts = {});
  const PowerSgdOptions& options() const { return opts_; }
  int64_t iteration() const { return iter_; }
  // Q of a bucket (the layout PyTorch's q_memory_dict has: every compressed
  // matrix's m x rank block, matrices grouped by shape in order of first
  // appearance): set it before the bucket's first compressed iteration to
  // start from a given Q instead of a random one (tests compare with PyTorch
  // this way); empty until then.
  std::vector<float>& q(size_t bucket) { return buckets_[bucket].q; }

  struct Bucket {
    std::vector<float> p, q, error;
    std::vector<float> next_error;  // the iteration under way's (swapped into error when it completes)
  };
  Bucket& bucket(size_t index) { return buckets_[index]; }
  void next_iteration() { ++iter_; }

  // What a checkpoint needs for the run to continue exactly (PyTorch's
  // PowerSGDState pickles the same): "powersgd.iteration" (int64, 1 value),
  // and per bucket b "powersgd.bucket<b>.q" and "powersgd.bucket<b>.error"
  // (f32). The error feedback is this rank's own: save one file per rank.
  std::vector<NamedTensor> state() const;
  // Loads what state() saved, replacing this state; without `with_error`
  // (another world size: the saving ranks' errors are not this rank's) only
  // the iteration and the Qs, the same on every rank. A Q or an error whose
  // size does not fit its bucket is dropped at the bucket's next use (a
  // fresh Q, zero error). Throws InvalidArgument, changing nothing, when a
  // tensor is malformed or the iteration is missing.
  void load_state(const std::vector<NamedTensor>& tensors, bool with_error = true);

 private:
  PowerSgdOptions opts_;
  int64_t iter_ = 0;
  std::map<size_t, Bucket> buckets_;
};

// Host f32 buckets (others throw InvalidArgument naming the bucket). Runs 3
// collectives per bucket in sequence (CommFuture::next): the uncompressed
// gradients, the Ps, the Qs.
COHORT_API CommHook powersgd_hook(std::shared_ptr<PowerSgdState> state);

// ---- Reducer ----

struct COHORT_API ReducerOptions {
  double bucket_cap_mb = 25.0;   // MiB, as PyTorch's bucket_cap_mb
  double first_bucket_mb = 1.0;  // MiB
  // BucketPlanOptions::count_multiple: every bucket padded to a multiple of
  // this many elements (zeros that no parameter owns). 1: no padding.
  size_t bucket_count_multiple = 1;
  // Parameters not marked ready by finalize() count as ready with the gradient
  // registered for them (zeros if none). Without it, finalize() throws naming them.
  bool find_unused_parameters = false;
  // The adapter makes each .grad a view of bucket_slot(i): mark_ready then
  // copies nothing, and finalize() leaves the result in the slots and writes
  // nothing back (on_reduced is not called).
  bool gradient_as_bucket_view = false;
  // The gradient given to mark_ready() stays valid and unchanged until
  // finalize() returns (the LibTorch adapter keeps it as .grad). The reducer
  // then copies into the bucket only what the group does not read in place
  // (ProcessGroup::allreduce_direct_block): on one host, the block of each
  // bucket that this rank reduces itself is read straight from the gradients.
  bool grads_valid_until_finalize = false;
  CommHook comm_hook;            // empty: allreduce_avg_hook()
  // Called by finalize() for every parameter, in registration order, with its
  // reduced gradient (valid until the next iteration), instead of copying it to
  // ParamSpec::grad. Runs on finalize()'s thread with the lock held.
  std::function<void(size_t param, const void* reduced)> on_reduced;
  Millis timeout{0};             // finalize()'s wait per bucket; zero: the group's timeout
  // Where buckets and gradients live (null: host memory). With gradients
  // outside host memory, grads_valid_until_finalize saves no copy (the group
  // reads only bucket memory), but lets the reducer hand each bucket's copies
  // to the memory in one batch at its launch (GradMemory::grads_to_buckets).
  std::shared_ptr<GradMemory> memory;
  // ZeRO-2's gradient memory. 0: every bucket has its own buffer for the
  // reducer's lifetime (a full replica of the gradients). K > 0: a bucket
  // has memory only while a synced iteration fills and reduces it: a buffer
  // of the largest bucket's size from a pool, taken at the bucket's first
  // gradient and given back once its hook's `then` has run. With K buffers
  // taken (or when one more would take as much as every bucket's own), the
  // next bucket first completes the oldest launched one (waits for its work
  // and runs its `then`, on the marking thread); the pool grows past K only
  // when none has launched (gradients that arrive out of plan order). When K
  // of the largest would take as much as all buckets (a model of few
  // buckets), every bucket keeps its own buffer instead, with the same rules
  // otherwise. Either way the hook is the results' only reader: finalize()
  // delivers nothing (neither ParamSpec::grad nor on_reduced),
  // bucket_slot() and bucket_data() throw, and mark_ready(p, nullptr) means
  // zeros. Needs buckets and gradients in one memory (the host's, or the
  // GPU's for a module there: no staging between the two), a comm_hook of
  // one step (no CommFuture::next), and neither gradient_as_bucket_view nor
  // on_reduced. The hook's `then`
  // must not issue collectives (it may run inside any rank's mark_ready, at
  // a point that differs across ranks). Waiting inside backward means a
  // slow peer can time a rank out mid-backward, and a parameter that
  // backward does not reach (find_unused_parameters) holds back every later
  // bucket until finalize(): the pool then grows to about every bucket.
  size_t recycled_buckets = 0;
};

using SteadyTime = std::chrono::steady_clock::time_point;

// One bucket in one synced iteration. Times are zero (time_since_epoch() == 0)
// for events that have not happened.
struct COHORT_API BucketStats {
  size_t index = 0;
  size_t bytes = 0;
  size_t params = 0;
  SteadyTime ready{};      // its last parameter became ready
  SteadyTime launched{};   // its hook was called
  SteadyTime completed{};  // the reducer first saw its Work complete (polled at each mark_ready, waited in finalize)
  // mark_ready() calls of this iteration made when it launched (-1: not launched).
  long marks_at_launch = -1;
  bool launched_in_finalize = false;  // held back by unused parameters until finalize()
};

struct COHORT_API IterationStats {
  uint64_t iteration = 0;        // synced iterations finalized before this one
  SteadyTime started{};          // prepare_for_backward() or the first mark_ready()
  SteadyTime finalized{};        // finalize() returned
  size_t marks = 0;              // mark_ready() calls
  size_t unused_params = 0;      // parameters finalize() had to mark (find_unused_parameters)
  size_t no_sync_marks = 0;      // mark_ready() calls under no_sync() between the previous synced iteration and this one
  std::vector<BucketStats> buckets;
  SteadyTime first_mark{};    // the first mark_ready(): backward's first gradient
  SteadyTime wait_started{};  // finalize() began waiting for the buckets: backward is over
};

class Reducer;

// While alive, mark_ready() only counts and finalize() does nothing: the
// framework accumulates gradients locally, and the next synced backward
// reduces the accumulated gradients. Nests.
class [[nodiscard]] COHORT_API NoSyncGuard {
 public:
  explicit NoSyncGuard(Reducer& r);
  ~NoSyncGuard();
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;

 private:
  Reducer& reducer_;
};

// Thread safety: mark_ready(), set_grad() and stats() may be called from
// several threads at once (autograd hooks); the other calls from one thread
// at a time, not while backward is running. The group must outlive the reducer, and the reducer
// must be the only user issuing collectives on the group during backward
// (collectives match across ranks by issue order).
class COHORT_API Reducer {
 public:
  // A collective: every rank of `group` constructs its reducer together. It
  // checks that all ranks registered the same parameters and bucket caps and
  // throws InvalidArgument naming the first rank that differs.
  Reducer(ProcessGroup& group, std::vector<ParamSpec> params, ReducerOptions opts = {});
  // Does not block. Bucket memory still in use by an unfinished collective
  // (after a failed finalize) is deliberately leaked rather than freed under it.
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Opens a synced iteration (call it in forward, like PyTorch). Optional: the
  // first mark_ready opens one too, but with this call a second backward
  // without finalize() is always reported as such. Throws "Expected to have
  // finished reduction in the prior iteration ..." if the previous iteration
  // marked parameters and was not finalized. Does nothing under no_sync().
  void prepare_for_backward();

  // Parameter `param`'s gradient for this backward is ready at `grad`
  // (ParamSpec::count elements of its dtype; read before the call returns).
  // grad == nullptr means: the registered ParamSpec::grad, or with
  // gradient_as_bucket_view the bucket slot. If `grad` is the bucket slot,
  // nothing is copied. Completing a bucket starts its communication (and that
  // of any later buckets already complete) before returning.
  // Throws if the parameter was already marked in this iteration, or if every
  // parameter was marked and finalize() was not called.
  void mark_ready(size_t param, const void* grad);

  // Ends the synced iteration: treats unmarked parameters as unused (with
  // find_unused_parameters; this launches the buckets they held back, so the
  // adapter must call finalize() even when it knows all gradients are ready),
  // waits for every bucket (ReducerOptions::timeout each), runs the hooks'
  // `then`, and delivers the results (see ParamSpec::grad, on_reduced,
  // gradient_as_bucket_view). Returns at once under no_sync(), or when no
  // parameter was marked since the last finalize() (no backward ran; so
  // calling it twice is harmless). Throws TimeoutError / PeerError from the
  // collectives, or Error naming unready parameters without
  // find_unused_parameters; after any of these the reducer refuses further
  // work (the ranks no longer agree on which collectives ran). Returns true
  // when it finalized a synced iteration (the results are delivered), false
  // when it returned at once.
  bool finalize();

  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*this); }
  // True while a no_sync() guard is alive.
  bool in_no_sync() const;
  // mark_ready() calls made under no_sync() since the last synced iteration
  // began (since construction if none did): nonzero means gradients were
  // accumulated locally and not reduced yet.
  size_t no_sync_marks() const;
  // With find_unused_parameters, after a finalize() that returned true: false
  // when no rank had a gradient for the parameter in that iteration (its
  // result is zeros; PyTorch leaves such a .grad as it was, none stays none).
  // Always true without find_unused_parameters.
  bool used_anywhere(size_t param) const;

  // The parameter's gradient storage changed (or became nullptr).
  void set_grad(size_t param, void* grad);
  // Where parameter `param` lives in its bucket's flat buffer (count elements
  // of its dtype). Stable for the reducer's lifetime. With
  // gradient_as_bucket_view the adapter makes the parameter's .grad a view of
  // it; otherwise it holds the reduced gradient after finalize().
  void* bucket_slot(size_t param);
  // The flat buffer of bucket `b` (plan()[b].count elements, padding
  // included). Stable for the reducer's lifetime; ZeRO shards it by rank.
  void* bucket_data(size_t b);

  // Bucket memory allocated now: every bucket's buffer, or the pool's.
  size_t bucket_memory_bytes() const;

  // Replaces the comm hook; only before the first synced iteration.
  void register_comm_hook(CommHook hook);

  const BucketPlan& plan() const;
  size_t num_params() const;
  // The open iteration's stats, or the last finalized one's.
  IterationStats stats() const;

 private:
  friend class NoSyncGuard;
  void enter_no_sync();
  void leave_no_sync();

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cohort::ddp
