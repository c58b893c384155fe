// FullyShardedDataParallel: parameters, gradients and optimizer state split
// across the ranks; each unit gathered only while it computes
// (include/cohort/torch_fsdp.hpp has the user's view, docs/fsdp.md the design).
//
// Per unit u (an FsdpUnit module, or the root: the parameters outside any):
//   - its trainable parameters, flattened in registration order and padded
//     to a multiple of N elements: `count`; rank r keeps chunk r (count / N)
//     in the shard buffer (private memory: see shard_units);
//   - one c10::StorageImpl that every parameter of the unit views. Gathered,
//     its data pointer is a slot of the gather pool, filled by the allgather;
//     freed, it points at nothing (nbytes 0). Autograd's saved tensors view
//     the same StorageImpl, so a unit gathered again for backward, into any
//     slot, is what they read. Neither step bumps a version counter;
//   - its gradient: when the post hooks of every parameter's gradient
//     accumulator have run (no later part of backward reads the unit), the
//     gradients are copied into a slot (the group's shared memory on the
//     CPU; on a GPU its memory, see State::device), .grad is dropped and
//     the slot is reduce-scattered (Avg) into a chunk; the end-of-backward
//     callback waits for these and adds each chunk into the gradient shard.
// Forward: pre_forward() gathers the root unit (kept until backward ends);
// FsdpUnit::forward gathers its unit (waiting for the prefetch when one is
// in flight), starts the next units' gathers (the order of the last
// iteration), runs, frees, and hooks the output's gradient: backward reaching
// it gathers the unit again and prefetches the one before it.
#include "cohort/torch_fsdp.hpp"

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string_view>

#include <fmt/format.h>

#include "backward_callback.hpp"
#include "cohort/error.hpp"
#include "device.hpp"
#include "cohort/torch.hpp"
#include "cohort/torch_train.hpp"
#include "shard_state.hpp"

namespace cohort::torch {

struct COHORT_HIDDEN FullyShardedDataParallel::State {
  struct Unit {
    std::string name;             // the FsdpUnit's module name; "" for the root
    std::vector<size_t> params;   // indices into State::params
    std::vector<size_t> offsets;  // each one's first element in the flat unit
    size_t used = 0, count = 0, chunk = 0;
    ::torch::ScalarType type = ::torch::kFloat;     // the shard's (master) dtype: the parameters' own
    DType dtype = DType::F32;
    ::torch::ScalarType compute = ::torch::kFloat;  // the gathered parameters' (FsdpOptions::param_dtype)
    DType compute_dtype = DType::F32;
    std::byte* shard = nullptr;       // chunk `rank` of the flat parameters
    std::byte* grad_shard = nullptr;  // the averaged gradient of that chunk, accumulated
    c10::Storage storage;             // what the parameters view
    int slot = -1;                    // the gather slot its data is in; -1: freed
    WorkPtr gathering;                // the allgather into it, until waited for
    size_t ready = 0;                 // gradients ready in this backward
    bool reduced = false;             // reduce-scattered (or, under no_sync, released) in this backward
    ::torch::Tensor shard_param;      // a 1-D view of `shard` whose .grad views `grad_shard`
    size_t bytes() const { return count * dtype_size(dtype); }
    size_t compute_bytes() const { return count * dtype_size(compute_dtype); }
    size_t chunk_bytes() const { return chunk * dtype_size(dtype); }
  };
  static constexpr size_t kMaxReductions = 2;
  struct Pending {  // a reduce_scatter in flight
    size_t unit;
    int slot;
    WorkPtr work;
    ::torch::Tensor into;  // bytes: the reduced chunk, added into grad_shard when done
  };

  ProcessGroup* group = nullptr;
  int rank = 0, n = 1;
  // Where the module is, and so every unit's shards, gather slots and
  // gradients: the CPU (Host: memcpy, the group's shared memory for the
  // slots) or the group's GPU (Device, on nccl: memory from LibTorch's
  // caching allocator, every copy and zeroing a LibTorch operation on its
  // current stream, every collective ordered after that stream, and the
  // stream, not the host, made to wait for a gather or a reduction).
  ::torch::Device device{::torch::kCPU};
  MemoryMode mode = MemoryMode::Host;
  // FsdpOptions::cpu_offload (Device mode only): the shards and gradient
  // shards, and so the optimizer's state and step, live in host memory; the
  // GPU holds only the gathered units. A gather copies this rank's chunk up
  // into its place in the slot and allgathers in place; a reduction's chunk
  // comes back down and is added on the host.
  bool offload = false;
  FsdpOptions opts;
  std::vector<::torch::Tensor> params;  // trainable, in the module's order
  std::vector<std::string> names;
  std::vector<Unit> units;              // units[0] is the root
  std::vector<size_t> unit_of;          // by parameter
  std::map<const void*, size_t> index_of;  // TensorImpl -> index into params
  std::vector<::torch::Tensor> buffers;
  std::vector<FsdpUnitBase*> unit_modules;  // by unit (nullptr for the root)
  using AccumulatorPtr = decltype(::torch::autograd::impl::grad_accumulator(std::declval<const ::torch::Tensor&>()));
  std::vector<AccumulatorPtr> accumulators;
  std::vector<uintptr_t> hook_keys;
  std::shared_ptr<std::byte[]> shards;  // every unit's chunk
  std::shared_ptr<std::byte[]> grad_shards;
  std::vector<std::shared_ptr<std::byte[]>> slots;  // the gather pool, each `slot_bytes`
  std::vector<bool> busy;
  // On a GPU, by slot: recorded on the stream that freed it, after the work
  // that used it (a unit's kernels, a reduction waited for). Whichever stream
  // takes the slot next waits for it: autograd runs a parameter's gradient
  // hook on the stream its accumulator was made on (FSDP's construction),
  // which need not be the stream forward and backward run on.
  std::vector<std::optional<c10::Event>> freed;
  // Per unit: this rank's chunk cut into runs of one param group each, as
  // optimizer parameters with their lengths (parameter_groups()); empty until then.
  std::vector<std::vector<std::pair<::torch::Tensor, size_t>>> runs;
  // The root unit, gathered for a whole step, has a buffer of its own size
  // rather than a slot of the largest unit's.
  static constexpr int kRootSlot = std::numeric_limits<int>::max();
  std::shared_ptr<std::byte[]> root_buffer;
  size_t root_bytes = 0;
  size_t slot_bytes = 0;
  std::deque<Pending> pending;
  std::vector<size_t> order, last_order;  // units as forward entered them: this iteration, the last
  bool open = false;                      // pre_forward() ran, its backward has not ended
  bool callback_queued = false;
  int no_sync = 0;
  bool failed = false;

  void check_usable() const {
    if (failed)
      throw Error("FullyShardedDataParallel: a collective failed, so the ranks no longer agree on the parameters; "
                  "this FSDP can no longer be used (restart from a checkpoint)");
  }
  void wait(const WorkPtr& w) {
    try {
      w->wait();
    } catch (...) {
      failed = true;  // its buffers may still be written: never freed (the destructor leaks them)
      throw;
    }
  }
  // What comes next waits for w: on a GPU the current stream (the host goes
  // on queueing the forward, the backward, the optimizer step), else the host.
  void wait_here(const WorkPtr& w) {
    if (mode == MemoryMode::Host) return wait(w);
    try {
      w->wait_on_stream(stream());
    } catch (...) {
      failed = true;
      throw;
    }
  }

  // The stream collectives issued now are ordered after (CudaStreamScope):
  // LibTorch's current one on a GPU, none on the CPU.
  void* stream() const { return current_stream_handle(device); }
  ::torch::TensorOptions on_device(::torch::ScalarType t) const { return ::torch::TensorOptions().dtype(t).device(device); }
  // Where the shards, their gradients and the optimizer state are: the
  // module's device, or the CPU under cpu_offload.
  ::torch::Device shard_device() const { return offload ? ::torch::Device(::torch::kCPU) : device; }
  ::torch::TensorOptions on_shard_device(::torch::ScalarType t) const {
    return ::torch::TensorOptions().dtype(t).device(shard_device());
  }
  // `count` elements of `t` at `data` in the shards' memory.
  ::torch::Tensor shard_tensor(void* data, size_t count, ::torch::ScalarType t) const {
    return wrap(data, {static_cast<int64_t>(count)}, on_shard_device(t));
  }
  void zero_shard(std::byte* data, size_t bytes) const {
    if (offload)
      std::memset(data, 0, bytes);
    else
      zero(data, bytes);
  }
  // `count` elements of `t` at `data` (FSDP's own memory: a shard, a slot).
  ::torch::Tensor tensor(void* data, size_t count, ::torch::ScalarType t) const {
    return wrap(data, {static_cast<int64_t>(count)}, on_device(t));
  }
  void zero(std::byte* data, size_t bytes) const { zero_own_bytes(data, bytes, mode, device); }
  // `bytes` zeroed bytes of FSDP's own memory (own_bytes: `shared` for the
  // gather slots, which peers read a chunk of on one host).
  std::shared_ptr<std::byte[]> memory(size_t bytes, bool shared) const {
    return own_bytes(*group, mode, device, bytes, shared);
  }
  // The same for the shards and gradient shards. Under cpu_offload host
  // memory: pinned (page-locked) for a GPU, so that a gather's copy up is
  // queued on the stream like any kernel (from pageable memory CUDA first
  // waits for everything queued before it); plain heap with the CPU as the
  // device (the test seam).
  std::shared_ptr<std::byte[]> shard_memory(size_t bytes) const {
    bytes = std::max<size_t>(bytes, 1);
    if (!offload) return memory(bytes, false);
    if (!device.is_cuda()) return own_bytes(*group, MemoryMode::Host, ::torch::kCPU, bytes, false);
    ::torch::Tensor t = ::torch::zeros({static_cast<int64_t>(bytes)},
                                       ::torch::TensorOptions().dtype(::torch::kByte).pinned_memory(true));
    auto* p = static_cast<std::byte*>(t.data_ptr());
    return std::shared_ptr<std::byte[]>(p, [t](std::byte*) mutable { t.reset(); });
  }
  // Under cpu_offload on a GPU: the host waits for everything queued on the
  // current stream, so that the host may write the shards (the optimizer's
  // step after backward, a load) that queued copies up may still read.
  void sync_with_stream() const {
    if (offload && device.is_cuda()) stream_now().synchronize();
  }

  // A free slot of the pool, allocating one when every slot is in use.
  int acquire() {
    for (size_t s = 0; s < slots.size(); ++s)
      if (!busy[s]) {
        busy[s] = true;
        if (freed[s]) freed[s]->block(stream_now());
        return static_cast<int>(s);
      }
    slots.push_back(memory(slot_bytes, true));
    busy.push_back(true);
    freed.emplace_back();
    return static_cast<int>(slots.size()) - 1;
  }
  void free_slot(int s) {
    const auto i = static_cast<size_t>(s);
    busy[i] = false;
    if (!device.is_cuda()) return;
    if (!freed[i]) freed[i].emplace(device.type());
    freed[i]->record(stream_now());
  }
  c10::Stream stream_now() const { return c10::impl::getDeviceGuardImpl(device.type())->getStream(device); }

  // The unit's parameters now view `bytes` at `data` (on the storage's own device).
  static void point_storage(Unit& u, void* data, size_t bytes) {
    c10::StorageImpl* impl = u.storage.unsafeGetStorageImpl();
    impl->set_data_ptr_noswap(c10::DataPtr(data, impl->device()));
    impl->set_nbytes(bytes);
  }

  // Starts gathering unit u (nothing when it is gathered or on its way).
  // Mixed precision: this rank's chunk cast into its place in the slot, then
  // an in-place allgather in the compute dtype.
  void gather(size_t i) {
    Unit& u = units[i];
    if (u.slot >= 0 || u.count == 0) return;
    u.slot = i == 0 ? kRootSlot : acquire();
    std::byte* full = i == 0 ? root_buffer.get() : slots[static_cast<size_t>(u.slot)].get();
    point_storage(u, full, u.compute_bytes());
    CudaStreamScope scope(stream());  // after the step that wrote the shard, the kernels that read the slot last
    if (u.compute == u.type && !offload) {
      u.gathering = group->allgather(Buffer{u.shard, u.chunk, u.dtype}, Buffer{full, u.count, u.dtype});
      return;
    }
    // This rank's chunk into its place in the slot (cast to the compute
    // dtype, up from the host under cpu_offload), then an in-place allgather.
    std::byte* mine = full + static_cast<size_t>(rank) * u.chunk * dtype_size(u.compute_dtype);
    ::torch::NoGradGuard no_grad;
    // Asynchronous only while autograd records (a backward follows, whose end
    // waits for the stream before the optimizer may write the shards); an
    // evaluation's forward copies synchronously, since nothing waits after it.
    const bool async = offload && ::torch::GradMode::is_enabled();
    tensor(mine, u.chunk, u.compute).copy_(shard_tensor(u.shard, u.chunk, u.type), /*non_blocking=*/async);
    u.gathering = group->allgather(Buffer{mine, u.chunk, u.compute_dtype}, Buffer{full, u.count, u.compute_dtype});
  }
  // Unit u gathered and complete.
  void materialize(size_t i) {
    gather(i);
    Unit& u = units[i];
    if (u.gathering) {
      WorkPtr w = std::move(u.gathering);
      wait_here(w);
    }
  }
  void release(size_t i) {
    Unit& u = units[i];
    if (u.slot < 0) return;
    if (u.gathering) {  // a prefetch never used: it still writes into the slot
      WorkPtr w = std::move(u.gathering);
      wait(w);
    }
    point_storage(u, nullptr, 0);
    if (u.slot != kRootSlot) free_slot(u.slot);
    u.slot = -1;
  }

  // The units forward runs after `i` (by the last iteration's order), gathered ahead.
  void prefetch_after(size_t position) {
    for (int k = 1; k <= opts.prefetch; ++k)
      if (position + static_cast<size_t>(k) < last_order.size()) gather(last_order[position + static_cast<size_t>(k)]);
  }
  void prefetch_before(size_t i) {
    const auto at = std::find(order.rbegin(), order.rend(), i);
    if (at == order.rend()) return;
    size_t position = static_cast<size_t>(order.rend() - at) - 1;
    for (int k = 1; k <= opts.prefetch && position >= static_cast<size_t>(k); ++k)
      gather(order[position - static_cast<size_t>(k)]);
  }

  void enter(size_t i) {
    check_usable();
    if (!open)
      throw InvalidArgument(fmt::format("FullyShardedDataParallel: unit '{}' ran forward before pre_forward(); its "
                                        "parameters live sharded and the root unit is gathered there. HINT: call "
                                        "fsdp.pre_forward() before each forward of the model",
                                        units[i].name));
    order.push_back(i);
    materialize(i);
    if (order.size() <= last_order.size() && last_order[order.size() - 1] == i) prefetch_after(order.size() - 1);
  }

  void queue_end_of_backward(const std::shared_ptr<State>& self) {
    if (callback_queued) return;
    callback_queued = true;
    detail::queue_backward_callback([weak = std::weak_ptr<State>(self)] {
      if (auto s = weak.lock()) s->end_backward();
    });
  }

  // Backward reached unit i's output: its parameters are needed again.
  void pre_backward(size_t i, const std::shared_ptr<State>& self) {
    check_usable();
    check_open("backward reached a unit");
    queue_end_of_backward(self);
    materialize(i);
    prefetch_before(i);
  }

  void grad_ready(size_t p, const std::shared_ptr<State>& self) {
    check_open("a gradient was accumulated");
    queue_end_of_backward(self);
    Unit& u = units[unit_of[p]];
    if (++u.ready == u.params.size() && !u.reduced) reduce(unit_of[p]);
  }

  // Unit i's gradients (zeros where none) to the slot, reduce-scattered
  // into this rank's chunk; its parameters freed.
  void reduce(size_t i) {
    Unit& u = units[i];
    u.reduced = true;
    if (no_sync > 0 || u.count == 0) {  // .grad keeps the whole gradient for the next synced backward
      if (i > 0) release(i);  // (the root stays until the next pre_forward(): end_backward)
      return;
    }
    for (size_t p : u.params) {  // checked before anything is taken
      const auto& g = params[p].grad();
      if (g.defined() && (g.is_sparse() || g.scalar_type() != u.compute || g.sizes() != params[p].sizes()))
        throw InvalidArgument(fmt::format("FullyShardedDataParallel: the gradient of '{}' is a {} {} tensor of shape "
                                          "{}; FSDP reduces dense {} gradients of the parameter's shape",
                                          names[p], g.is_sparse() ? "sparse" : "dense", c10::toString(g.scalar_type()),
                                          c10::str(g.sizes()), c10::toString(u.compute)));
    }
    reap(false);
    // At most kMaxReductions in flight (each holds a slot of the pool): a
    // slow transport must not grow the pool to the whole model.
    while (pending.size() >= kMaxReductions) reap_one();
    const int s = acquire();
    std::byte* full = slots[static_cast<size_t>(s)].get();
    const size_t es = dtype_size(u.dtype);
    for (size_t j = 0; j < u.params.size(); ++j) {
      ::torch::Tensor& p = params[u.params[j]];
      std::byte* to = full + u.offsets[j] * es;
      const size_t bytes = static_cast<size_t>(p.numel()) * es;
      const auto& g = p.grad();
      if (!g.defined()) {
        zero(to, bytes);
      } else if (u.compute == u.type && mode == MemoryMode::Host) {
        const ::torch::Tensor c = g.contiguous();
        std::memcpy(to, c.data_ptr(), bytes);
      } else {  // on the GPU's stream; under mixed precision reduced in the master dtype
        ::torch::NoGradGuard no_grad;
        wrap(to, p.sizes(), on_device(u.type)).copy_(g);
      }
      p.mutable_grad().reset();
    }
    zero(full + u.used * es, (u.count - u.used) * es);
    if (i > 0) release(i);
    Pending r{.unit = i, .slot = s, .work = {}, .into = ::torch::empty({static_cast<int64_t>(u.chunk_bytes())}, on_device(::torch::kByte))};
    CudaStreamScope scope(stream());  // after the copies above
    r.work = group->reduce_scatter(Buffer{full, u.count, u.dtype}, Buffer{r.into.data_ptr(), u.chunk, u.dtype},
                                   {.op = ReduceOp::Avg});
    pending.push_back(std::move(r));
  }

  // Completed reductions into the gradient shards (all of them: wait).
  void reap(bool all) {
    while (!pending.empty() && (all || pending.front().work->is_completed())) reap_one();
  }
  // The oldest reduction (waited for) added into its gradient shard.
  void reap_one() {
    Pending& r = pending.front();
    wait_here(r.work);
    Unit& u = units[r.unit];
    attach_shard_grad(u);  // (cleared first if the optimizer set it to none)
    attach_run_grads(r.unit);
    ::torch::NoGradGuard no_grad;
    const ::torch::Tensor reduced = tensor(r.into.data_ptr(), u.chunk, u.type);
    // (Under cpu_offload down to the host first: after the wait above, on the stream that waited.)
    shard_tensor(u.grad_shard, u.chunk, u.type).add_(offload ? reduced.to(::torch::kCPU) : reduced);
    // The add above reads `into` on this stream, which may not be the one it
    // was allocated on (a hook's): LibTorch's allocator must not hand it out there before.
    if (device.is_cuda())
      c10::impl::getDeviceGuardImpl(device.type())->recordDataPtrOnStream(r.into.storage().data_ptr(), stream_now());
    free_slot(r.slot);
    pending.pop_front();
  }

  // A backward that failed before its end (an exception in a hook or a
  // collective): what it started is finished, nothing of it kept beyond the
  // gradients it already reduced (zero_grad() clears those).
  void recover_from_failed_backward() {
    if (!callback_queued) return;
    callback_queued = false;
    sync_with_stream();
    reap(true);
    for (size_t i = 0; i < units.size(); ++i) {
      release(i);
      units[i].ready = 0;
      units[i].reduced = false;
    }
    for (auto& p : params) p.mutable_grad().reset();  // what the failed backward left unreduced
  }

  // End of backward (autograd's callback): every unit not yet reduced is
  // (zeros for its missing gradients: the same collectives on every rank),
  // the reductions are added into the shards, every unit freed.
  // The root unit stays gathered until the next pre_forward(): a second
  // backward over this graph (retain_graph) then reaches a unit's hook and is
  // refused by name, instead of reading a freed root first.
  void end_backward() {
    for (size_t i = 0; i < units.size(); ++i)
      if (!units[i].reduced) reduce(i);
    reap(true);
    for (size_t i = 0; i < units.size(); ++i) {
      if (i > 0) release(i);
      units[i].ready = 0;
      units[i].reduced = false;
    }
    attach_shard_grads();
    sync_with_stream();  // (cpu_offload) before the optimizer steps the host shards the gathers read
    last_order = std::move(order);
    order.clear();
    open = false;
    callback_queued = false;
  }

  // Every shard's .grad is the view of its gradient shard again. An
  // optimizer's zero_grad() sets .grad to none (LibTorch's default): that
  // clears the shard, as fsdp.zero_grad() does.
  void attach_shard_grads() {
    for (size_t i = 0; i < units.size(); ++i)
      if (units[i].chunk > 0) {
        attach_shard_grad(units[i]);
        attach_run_grads(i);
      }
  }
  // The same for the runs of parameter_groups(): an optimizer over them sets
  // their .grad to none, which clears that part of the gradient shard.
  void attach_run_grads(size_t unit) {
    if (runs.empty()) return;
    Unit& u = units[unit];
    const size_t elem = dtype_size(u.dtype);
    size_t start = 0;
    for (auto& [param, len] : runs[unit]) {
      std::byte* at = u.grad_shard + start * elem;
      auto& g = param.mutable_grad();
      if (!g.defined()) zero_shard(at, len * elem);
      if (!g.defined() || g.data_ptr() != static_cast<void*>(at))
        g = wrap(at, {static_cast<int64_t>(len)}, on_shard_device(u.type), grad_shards);
      start += len;
    }
  }
  void attach_shard_grad(Unit& u) const {
    auto& g = u.shard_param.mutable_grad();
    if (g.defined() && g.data_ptr() == static_cast<void*>(u.grad_shard)) return;
    if (!g.defined()) zero_shard(u.grad_shard, u.chunk_bytes());
    g = wrap(u.grad_shard, {static_cast<int64_t>(u.chunk)}, on_shard_device(u.type), grad_shards);
  }

  // A hook of a backward that runs after this iteration's backward ended.
  void check_open(const char* what) const {
    if (!open)
      throw InvalidArgument(fmt::format(
          "FullyShardedDataParallel: {} after the backward of this forward had ended; FSDP reduced and freed the "
          "units then, so a second backward over one graph (retain_graph, autograd::grad then backward) is not "
          "supported. HINT: run the forward again (after pre_forward()) for each backward",
          what));
  }
};

namespace {

class GradReady final : public ::torch::autograd::FunctionPostHook {
 public:
  GradReady(std::weak_ptr<FullyShardedDataParallel::State> s, size_t p) : s_(std::move(s)), p_(p) {}
  ::torch::autograd::variable_list operator()(const ::torch::autograd::variable_list& outputs,
                                              const ::torch::autograd::variable_list&) override {
    if (auto s = s_.lock()) s->grad_ready(p_, s);
    return outputs;
  }

 private:
  std::weak_ptr<FullyShardedDataParallel::State> s_;
  size_t p_;
};

}  // namespace

// ---- Sharded construction ----

// A unit sharded when it was built (FsdpShardedInit), waiting for its FSDP.
struct FsdpPreShard {
  int world = 1, rank = 0;
  std::vector<const void*> impls;  // its trainable parameters (TensorImpl), in order
  c10::Storage storage;            // what they view (freed)
  ::torch::Tensor chunk;           // this rank's chunk of rank 0's values
  size_t used = 0, count = 0;
};

namespace {
thread_local FsdpShardedInit* g_sharded_init = nullptr;

void free_storage(c10::Storage& storage) {
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(c10::DataPtr(nullptr, impl->device()));
  impl->set_nbytes(0);
}

// Where FsdpShardedInit puts a unit: the group's GPU (nccl), else the CPU.
::torch::Device init_device(const ProcessGroup& g) {
  const int gpu = g.cuda_device();
  return gpu >= 0 ? ::torch::Device(::torch::kCUDA, static_cast<c10::DeviceIndex>(gpu)) : ::torch::Device(::torch::kCPU);
}
}  // namespace

FsdpShardedInit::FsdpShardedInit(std::shared_ptr<ProcessGroup> group) : group_(std::move(group)), previous_(g_sharded_init) {
  if (!group_) throw InvalidArgument("FsdpShardedInit: the process group is null (call cohort::init_process_group())");
  g_sharded_init = this;
}
FsdpShardedInit::~FsdpShardedInit() { g_sharded_init = previous_; }
FsdpShardedInit* FsdpShardedInit::current() { return g_sharded_init; }

FsdpUnitBase::~FsdpUnitBase() = default;

void FsdpUnitBase::built() {
  FsdpShardedInit* init = FsdpShardedInit::current();
  if (!init) return;
  ProcessGroup& g = init->group();
  // Parameters of units nested in this one are theirs (and sharded already).
  std::set<const void*> nested;
  for (const auto& m : modules(/*include_self=*/false))
    if (auto* u = dynamic_cast<FsdpUnitBase*>(m.get()); u && u->pre_) nested.insert(u->pre_->impls.begin(), u->pre_->impls.end());
  auto pre = std::make_shared<FsdpPreShard>();
  pre->world = g.size();
  pre->rank = g.rank();
  std::vector<::torch::Tensor> params;
  for (const auto& item : named_parameters(true)) {
    const ::torch::Tensor& p = item.value();
    const void* impl = p.unsafeGetTensorImpl();
    if (!p.requires_grad() || nested.contains(impl) ||
        std::find(pre->impls.begin(), pre->impls.end(), impl) != pre->impls.end())
      continue;
    if (!params.empty() && p.scalar_type() != params.front().scalar_type())
      throw InvalidArgument(fmt::format("FsdpShardedInit: parameter '{}' is {} but the unit's first is {}; a unit is "
                                        "one flat tensor of one dtype",
                                        item.key(), c10::toString(p.scalar_type()),
                                        c10::toString(params.front().scalar_type())));
    if (!p.device().is_cpu() && p.device() != init_device(g))
      throw InvalidArgument(fmt::format("FsdpShardedInit: parameter '{}' is on {}, but units built under this {} group "
                                        "are sharded onto {}. HINT: build the model on the CPU (the default) inside "
                                        "FsdpShardedInit: each unit moves to the group's device as it is sharded",
                                        item.key(), p.device().str(), g.backend_name(), init_device(g).str()));
    params.push_back(p);
    pre->impls.push_back(impl);
    pre->used += static_cast<size_t>(p.numel());
  }
  if (params.empty()) return;
  const size_t n = static_cast<size_t>(pre->world);
  pre->count = (pre->used + n - 1) / n * n;
  const size_t chunk = pre->count / n;
  ::torch::NoGradGuard no_grad;
  // On the group's GPU (nccl): the unit is sharded there, and the rest of the
  // model follows it with module->to(device) (a no-op for these parameters).
  const ::torch::Device device = init_device(g);
  ::torch::Tensor flat = ::torch::zeros({static_cast<int64_t>(pre->count)},
                                        ::torch::TensorOptions().dtype(params.front().scalar_type()).device(device));
  int64_t at = 0;
  for (auto& p : params) {
    auto view = flat.narrow(0, at, p.numel()).view(p.sizes());
    view.copy_(p);
    p.set_data(view);  // frees the parameter's own memory
    at += p.numel();
  }
  {
    CudaStreamScope scope(current_stream_handle(device));  // after the copies
    wait_keeping(g.broadcast(Buffer{flat.data_ptr(), pre->count, to_dtype(flat.scalar_type())}), {flat});  // rank 0's values
  }
  pre->chunk = flat.narrow(0, static_cast<int64_t>(static_cast<size_t>(pre->rank) * chunk), static_cast<int64_t>(chunk)).clone();
  pre->storage = flat.storage();
  free_storage(pre->storage);
  pre_ = std::move(pre);
}

// ---- FsdpUnitBase ----

void FsdpUnitBase::enter() {
  if (!fsdp_) return;
  if (detail::in_recompute())
    throw InvalidArgument(fmt::format("FullyShardedDataParallel: unit '{}' runs inside recompute(); FSDP gathers and "
                                      "frees a unit around its own forward and backward, which a recomputation "
                                      "would run twice. HINT: recompute inside the unit (in the forward of the "
                                      "module FsdpUnit wraps), or do not recompute this part",
                                      fsdp_->state_->units[unit_].name));
  fsdp_->state_->enter(unit_);
}

::torch::Tensor FsdpUnitBase::cast_input(::torch::Tensor t) const {
  if (!fsdp_ || !t.defined() || !fsdp_->opts_.param_dtype || !t.is_floating_point() ||
      t.scalar_type() == *fsdp_->opts_.param_dtype)
    return t;
  return t.to(*fsdp_->opts_.param_dtype);
}

::torch::Tensor FsdpUnitBase::leave(::torch::Tensor out) {
  if (!fsdp_) return out;
  auto& st = fsdp_->state_;
  st->release(unit_);
  if (out.defined() && out.requires_grad()) {
    out.register_hook([weak = std::weak_ptr<FullyShardedDataParallel::State>(st), unit = unit_](const ::torch::Tensor&) {
      if (auto s = weak.lock()) s->pre_backward(unit, s);
    });
  }
  return out;
}


// ---- Construction ----

namespace {

using Unit = FullyShardedDataParallel::State::Unit;

size_t round64(size_t bytes) { return (bytes + 63) / 64 * 64; }

// The unit a parameter named `name` belongs to: the FsdpUnit with the longest
// name that prefixes it, else the root (0).
template <class U>
size_t unit_for(const std::string& name, const std::vector<U>& units) {
  size_t best = 0, best_len = 0;
  for (size_t u = 1; u < units.size(); ++u) {
    const std::string& prefix = units[u].name;
    if (name.size() > prefix.size() && name.compare(0, prefix.size(), prefix) == 0 && name[prefix.size()] == '.' &&
        prefix.size() + 1 > best_len) {
      best = u;
      best_len = prefix.size() + 1;
    }
  }
  return best;
}

template <class U>
std::string unit_label(const U& u) {
  return u.name.empty() ? std::string("the root unit") : fmt::format("unit '{}'", u.name);
}

}  // namespace

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<::torch::nn::Module> module,
                                                   std::shared_ptr<ProcessGroup> group, FsdpOptions opts)
    : module_(std::move(module)), group_(std::move(group)), opts_(opts), state_(std::make_shared<State>()) {
  constexpr const char* kWho = "FullyShardedDataParallel";
  if (!module_) throw InvalidArgument(fmt::format("{}: the module is null", kWho));
  if (!group_) throw InvalidArgument(fmt::format("{}: the process group is null (call cohort::init_process_group())", kWho));
  if (opts_.prefetch < 0)
    throw InvalidArgument(fmt::format("{}: prefetch must be >= 0 (got {}); 0 gathers each unit only when it runs", kWho,
                                      opts_.prefetch));
  if (dynamic_cast<FsdpUnitBase*>(module_.get()))
    throw InvalidArgument(fmt::format("{}: the model itself is an FsdpUnit; wrap its blocks in FsdpUnit instead: the "
                                      "parameters outside every unit form the root unit by themselves",
                                      kWho));
  State& st = *state_;
  st.group = group_.get();
  st.rank = group_->rank();
  st.n = group_->size();
  st.opts = opts_;
  st.units.push_back(Unit{});  // the root
  st.unit_modules.push_back(nullptr);
  for (const auto& item : module_->named_modules("", /*include_self=*/false))
    if (auto* m = dynamic_cast<FsdpUnitBase*>(item.value().get())) {
      if (m->fsdp_)
        throw InvalidArgument(fmt::format("{}: unit '{}' already belongs to another FullyShardedDataParallel", kWho,
                                          item.key()));
      Unit u;
      u.name = item.key();
      st.units.push_back(std::move(u));
      st.unit_modules.push_back(m);
    }

  // Trainable parameters by unit; a tensor in two units is refused.
  std::vector<::torch::Tensor> frozen, all_tensors;
  std::vector<std::string> frozen_names;
  place_on_device();
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
    const ::torch::Tensor& p = item.value();
    const size_t u = unit_for(item.key(), st.units);
    const auto seen = st.index_of.find(p.unsafeGetTensorImpl());
    if (seen != st.index_of.end()) {
      const size_t first = st.unit_of[seen->second];
      if (first != u)
        throw InvalidArgument(fmt::format(
            "{}: parameter '{}' of {} is the same tensor as '{}' of {}: a parameter shared between units (tied "
            "weights) cannot live in two shards. HINT: wrap the modules that share it in one FsdpUnit, or leave "
            "the shared one in a unit that contains both",
            kWho, item.key(), unit_label(st.units[u]), st.names[seen->second], unit_label(st.units[first])));
      continue;  // tied within one unit: one parameter
    }
    if (!p.requires_grad()) {
      frozen.push_back(p);
      frozen_names.push_back(item.key());
      continue;
    }
    Unit& unit = st.units[u];
    if (!unit.params.empty() && p.scalar_type() != unit.type)
      throw InvalidArgument(fmt::format("{}: parameter '{}' is {} but {} holds {} ones ('{}'); a unit is one flat "
                                        "tensor of one dtype. HINT: convert the module to one dtype, or split the unit",
                                        kWho, item.key(), c10::toString(p.scalar_type()), unit_label(unit),
                                        c10::toString(unit.type), st.names[unit.params.front()]));
    unit.type = p.scalar_type();
    unit.dtype = to_dtype(p.scalar_type());
    unit.compute = opts_.param_dtype.value_or(unit.type);
    unit.compute_dtype = to_dtype(unit.compute);
    if (opts_.param_dtype && !(c10::isFloatingType(unit.type) && c10::isFloatingType(unit.compute)))
      throw InvalidArgument(fmt::format("{}: param_dtype {} for parameter '{}' of {}: mixed precision casts floating "
                                        "parameters to a floating dtype",
                                        kWho, c10::toString(unit.compute), item.key(), c10::toString(unit.type)));
    unit.params.push_back(st.params.size());
    unit.offsets.push_back(unit.used);
    unit.used += static_cast<size_t>(p.numel());
    st.index_of[p.unsafeGetTensorImpl()] = st.params.size();
    st.unit_of.push_back(u);
    st.params.push_back(p);
    st.names.push_back(item.key());
  }
  std::vector<std::string> buffer_names;
  for (const auto& b : module_->named_buffers(true)) {
    st.buffers.push_back(b.value());
    buffer_names.push_back(b.key());
  }

  // The same units and parameters everywhere, then rank 0's values.
  std::vector<std::string> unit_names;
  std::vector<::torch::Tensor> unit_shapes;
  for (const auto& u : st.units) {
    unit_names.push_back(u.name.empty() ? std::string("(root)") : u.name);
    unit_shapes.push_back(::torch::empty({static_cast<int64_t>(u.used)}, ::torch::TensorOptions().dtype(u.type)));
  }
  check_same_parameters(*group_, unit_names, unit_shapes, "FSDP unit");
  check_same_parameters(*group_, st.names, st.params, "parameter");
  check_same_parameters(*group_, frozen_names, frozen, "frozen parameter");
  check_same_parameters(*group_, buffer_names, st.buffers, "buffer");
  check_pre_sharded();
  for (size_t i = 0; i < st.params.size(); ++i)  // units sharded at construction hold rank 0's values already
    if (!st.unit_modules[st.unit_of[i]] || !st.unit_modules[st.unit_of[i]]->pre_) all_tensors.push_back(st.params[i]);
  all_tensors.insert(all_tensors.end(), frozen.begin(), frozen.end());
  all_tensors.insert(all_tensors.end(), st.buffers.begin(), st.buffers.end());
  broadcast_tensors(*group_, all_tensors, 0);
  shard_units();
}

// The module's device (one for all its parameters and buffers) and the mode
// it trains in with this group: a CPU module on a host group, or a GPU module
// on nccl, whose collectives move that GPU's memory. A GPU module on a host
// group is refused: unlike DDP, which can stage a bucket through host memory,
// FSDP gathers every unit twice a step and would copy the model across PCIe each time.
void FullyShardedDataParallel::place_on_device() {
  constexpr const char* kWho = "FullyShardedDataParallel";
  State& st = *state_;
  std::vector<std::string> names;
  std::vector<::torch::Tensor> tensors;
  for (const auto& item : module_->named_parameters(true)) {
    names.push_back(item.key());
    tensors.push_back(item.value());
  }
  for (const auto& item : module_->named_buffers(true)) {
    names.push_back(item.key());
    tensors.push_back(item.value());
  }
  st.device = common_device(names, tensors, kWho);
  st.mode = memory_mode(st.device, *group_, kWho);
  if (st.mode == MemoryMode::Staged)
    throw InvalidArgument(fmt::format(
        "{}: the module is on {}, but the {} backend moves host memory; FSDP keeps each unit's shard, gathers and "
        "gradients on the module's device and moves them with the group's collectives, so a GPU module needs the "
        "nccl backend (docs/fsdp.md). HINT: COHORT_BACKEND=nccl, one process per GPU; or keep the module on the CPU",
        kWho, st.device.str(), group_->backend_name()));
  if (opts_.cpu_offload && st.mode != MemoryMode::Device)
    throw InvalidArgument(fmt::format("{}: cpu_offload is for a module on a GPU (it keeps the shards and the "
                                      "optimizer step in host memory); this module is on the CPU, where they are "
                                      "already. HINT: leave cpu_offload off",
                                      kWho));
  st.offload = opts_.cpu_offload;
}

// A unit sharded at construction (FsdpShardedInit) must be the unit this
// FSDP found, for this group.
void FullyShardedDataParallel::check_pre_sharded() {
  State& st = *state_;
  for (size_t p = 0; p < st.params.size(); ++p) {
    const FsdpUnitBase* m = st.unit_modules[st.unit_of[p]];
    if ((m == nullptr || !m->pre_) && st.params[p].numel() > 0 && st.params[p].storage().nbytes() == 0)
      throw InvalidArgument(fmt::format("FullyShardedDataParallel: parameter '{}' has no data: it was sharded by an "
                                        "earlier FSDP (destroyed since) or an FsdpShardedInit of another model. "
                                        "HINT: save full_state() before dropping an FSDP and load it into a fresh "
                                        "model",
                                        st.names[p]));
  }
  for (size_t i = 1; i < st.units.size(); ++i) {
    const auto& pre = st.unit_modules[i]->pre_;
    if (!pre) continue;
    const Unit& u = st.units[i];
    if (pre->world != st.n || pre->rank != st.rank)
      throw InvalidArgument(fmt::format("FullyShardedDataParallel: unit '{}' was sharded at construction as rank {} "
                                        "of {}, but this group makes it rank {} of {}. HINT: build the model under "
                                        "FsdpShardedInit with the group FSDP gets",
                                        u.name, pre->rank, pre->world, st.rank, st.n));
    bool same = pre->impls.size() == u.params.size();
    for (size_t j = 0; same && j < u.params.size(); ++j)
      same = pre->impls[j] == st.params[u.params[j]].unsafeGetTensorImpl();
    if (!same)
      throw InvalidArgument(fmt::format("FullyShardedDataParallel: unit '{}' was sharded at construction with {} "
                                        "parameters, but holds {} now (a unit nested in it built outside "
                                        "FsdpShardedInit, or parameters replaced since). HINT: build the whole model "
                                        "inside one FsdpShardedInit and change it only after FSDP wraps it",
                                        u.name, pre->impls.size(), u.params.size()));
  }
}

// Every unit flattened, this rank's chunk kept, the rest freed.
void FullyShardedDataParallel::shard_units() {
  State& st = *state_;
  const size_t n = static_cast<size_t>(st.n);
  size_t shard_total = 0;
  std::vector<size_t> at;
  for (auto& u : st.units) {
    u.count = (u.used + n - 1) / n * n;
    u.chunk = u.count / n;
    at.push_back(shard_total);
    shard_total += round64(u.chunk_bytes());
    st.slot_bytes = std::max({st.slot_bytes, round64(u.bytes()), round64(u.compute_bytes())});
  }
  // Private memory, not a shared buffer: a single-copy allgather would map
  // every peer's shards into each rank (their pages counted in its resident
  // set, the whole model's worth by the end of a step); the ring moves a
  // chunk through the transport's slots instead. The gather slots, which
  // peers read only a chunk of in the reduce-scatter, stay shared.
  st.shards = st.shard_memory(std::max<size_t>(shard_total, 64));
  if (st.units[0].count > 0) {
    st.root_bytes = std::max(round64(st.units[0].bytes()), round64(st.units[0].compute_bytes()));
    st.root_buffer = st.memory(st.root_bytes, true);
  }
  // (Under cpu_offload plain heap: only the host writes it, from a
  // synchronous copy down, so page-locking it would buy nothing.)
  st.grad_shards = st.offload ? own_bytes(*st.group, MemoryMode::Host, ::torch::kCPU, std::max<size_t>(shard_total, 64), false)
                              : st.shard_memory(std::max<size_t>(shard_total, 64));  // zeroed
  ::torch::NoGradGuard no_grad;
  for (size_t i = 0; i < st.units.size(); ++i) {
    Unit& u = st.units[i];
    if (u.count == 0) continue;
    u.shard = st.shards.get() + at[i];
    u.grad_shard = st.grad_shards.get() + at[i];
    const auto opt = st.on_device(u.type);
    const ::torch::Tensor shard = st.shard_tensor(u.shard, u.chunk, u.type);
    FsdpUnitBase* module = st.unit_modules[i];
    if (module && module->pre_) {  // sharded at construction: its chunk is ready
      shard.copy_(module->pre_->chunk);
      u.storage = module->pre_->storage;
      module->pre_.reset();
      if (u.compute != u.type) {  // the parameters view a storage of the compute dtype instead
        ::torch::Tensor flat = ::torch::empty({static_cast<int64_t>(u.count)}, st.on_device(u.compute));
        for (size_t j = 0; j < u.params.size(); ++j) {
          ::torch::Tensor& p = st.params[u.params[j]];
          p.set_data(flat.narrow(0, static_cast<int64_t>(u.offsets[j]), p.numel()).view(p.sizes()));
        }
        u.storage = flat.storage();
      }
    } else {
      ::torch::Tensor flat = ::torch::zeros({static_cast<int64_t>(u.count)}, opt);
      for (size_t j = 0; j < u.params.size(); ++j) {
        ::torch::Tensor& p = st.params[u.params[j]];
        auto view = flat.narrow(0, static_cast<int64_t>(u.offsets[j]), p.numel()).view(p.sizes());
        view.copy_(p);
        p.set_data(view);  // the parameter now views the unit's storage
      }
      shard.copy_(flat.narrow(0, static_cast<int64_t>(static_cast<size_t>(st.rank) * u.chunk), static_cast<int64_t>(u.chunk)));
      if (u.compute != u.type) {  // mixed precision: the parameters view a compute-dtype storage
        flat = flat.to(u.compute);
        for (size_t j = 0; j < u.params.size(); ++j) {
          ::torch::Tensor& p = st.params[u.params[j]];
          p.set_data(flat.narrow(0, static_cast<int64_t>(u.offsets[j]), p.numel()).view(p.sizes()));
        }
      }
      u.storage = flat.storage();
    }
    State::point_storage(u, nullptr, 0);  // the whole unit freed; this rank's chunk lives on in the shard
    u.shard_param = wrap(u.shard, {static_cast<int64_t>(u.chunk)}, st.on_shard_device(u.type), st.shards);
    u.shard_param.requires_grad_(true);
    u.shard_param.mutable_grad() = wrap(u.grad_shard, {static_cast<int64_t>(u.chunk)}, st.on_shard_device(u.type), st.grad_shards);
  }
  for (size_t i = 0; i < st.params.size(); ++i) {
    auto acc = ::torch::autograd::impl::grad_accumulator(st.params[i]);
    st.hook_keys.push_back(acc->add_post_hook(std::make_unique<GradReady>(state_, i)));
    st.accumulators.push_back(std::move(acc));
  }
  for (size_t i = 1; i < st.units.size(); ++i) {
    st.unit_modules[i]->fsdp_ = this;
    st.unit_modules[i]->unit_ = i;
  }
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  State& st = *state_;
  for (size_t i = 0; i < st.accumulators.size(); ++i) st.accumulators[i]->del_post_hook(st.hook_keys[i]);
  for (auto* m : st.unit_modules)
    if (m) m->fsdp_ = nullptr;
  bool running = st.failed;
  for (const auto& r : st.pending) running |= !r.work->is_completed();
  for (const auto& u : st.units) running |= u.gathering && !u.gathering->is_completed();
  if (running) {
    // A collective may still write into the slots or read the shards: never
    // free them under it (as ZeroOptimizer and the reducer leak theirs).
    (void)new std::shared_ptr<State>(state_);
    return;
  }
  // Kernels queued on the current stream may still read the slots and the
  // shards (a last forward's copies, an offloaded shard's copy up): the
  // memory goes back to LibTorch's allocators only after them.
  if (st.device.is_cuda()) st.stream_now().synchronize();
  for (size_t i = 0; i < st.units.size(); ++i) st.release(i);
}

// ---- Training ----

void FullyShardedDataParallel::pre_forward() {
  State& st = *state_;
  st.check_usable();
  st.recover_from_failed_backward();
  for (size_t i = 0; i < st.units.size(); ++i) st.release(i);
  if (!st.order.empty()) st.last_order = std::move(st.order);
  st.order.clear();
  st.materialize(0);
  if (opts_.broadcast_buffers && st.n > 1 && !st.buffers.empty()) broadcast_tensors(*group_, st.buffers, 0);
  st.open = true;
}

std::vector<::torch::Tensor> FullyShardedDataParallel::parameters() const {
  std::vector<::torch::Tensor> out;
  for (const auto& u : state_->units)
    if (u.chunk > 0) out.push_back(u.shard_param);
  return out;
}

void FullyShardedDataParallel::zero_grad() {
  State& st = *state_;
  st.check_usable();
  st.recover_from_failed_backward();
  for (size_t i = 0; i < st.units.size(); ++i)
    if (st.units[i].chunk > 0) {
      st.zero_shard(st.units[i].grad_shard, st.units[i].chunk_bytes());
      st.attach_shard_grad(st.units[i]);
      st.attach_run_grads(i);
    }
  for (auto& p : st.params) p.mutable_grad().reset();  // what no_sync accumulated
}

std::vector<std::vector<::torch::Tensor>> FullyShardedDataParallel::parameter_groups(
    const std::vector<std::vector<std::string>>& groups) {
  State& st = *state_;
  st.check_usable();
  constexpr const char* kWho = "FullyShardedDataParallel::parameter_groups";
  if (!st.runs.empty())
    throw InvalidArgument(fmt::format("{}: called a second time; the first call's tensors are the ones to optimize "
                                      "(call it once)",
                                      kWho));
  // Every name the model has for a trainable parameter (a tensor registered
  // twice, tied within a unit, answers to both).
  std::map<std::string, size_t> index_by_name;
  for (const auto& item : module_->named_parameters(true))
    if (const auto it = st.index_of.find(item.value().unsafeGetTensorImpl()); it != st.index_of.end())
      index_by_name.emplace(item.key(), it->second);
  const std::vector<size_t> group_of =
      shard::assign_groups(index_by_name, st.names, st.params.size(), groups, std::string(kWho) + ": ", "group");
  std::vector<std::vector<::torch::Tensor>> out(groups.size() + 1);
  std::vector<std::vector<std::pair<::torch::Tensor, size_t>>> runs(st.units.size());
  std::vector<size_t> sizes;  // by parameter
  for (const auto& p : st.params) sizes.push_back(static_cast<size_t>(p.numel()));
  for (size_t i = 0; i < st.units.size(); ++i) {
    Unit& u = st.units[i];
    if (u.chunk == 0) continue;
    const size_t elem = dtype_size(u.dtype);
    for (const shard::RunSpan& r : shard::runs_of(u.params, u.offsets, sizes, group_of, u.count, u.chunk, st.rank)) {
      const auto opt = st.on_shard_device(u.type);
      auto t = wrap(u.shard + r.start * elem, {static_cast<int64_t>(r.len)}, opt, st.shards);
      t.requires_grad_(true);
      // The gradient shard as it is (gradients reduced before this call are kept).
      t.mutable_grad() = wrap(u.grad_shard + r.start * elem, {static_cast<int64_t>(r.len)}, opt, st.grad_shards);
      runs[i].emplace_back(t, r.len);
      out[r.group].push_back(t);
    }
  }
  st.runs = std::move(runs);
  return out;
}

FullyShardedDataParallel::NoSync FullyShardedDataParallel::no_sync() {
  state_->check_usable();
  ++state_->no_sync;
  return NoSync(this);
}
FullyShardedDataParallel::NoSync::~NoSync() {
  if (f_) --f_->state_->no_sync;
}

double FullyShardedDataParallel::clip_grad_norm(double max_norm) {
  State& st = *state_;
  st.check_usable();
  if (!(max_norm > 0) || !std::isfinite(max_norm))
    throw InvalidArgument(fmt::format("FullyShardedDataParallel::clip_grad_norm: max_norm must be a finite number > 0 "
                                      "(got {})",
                                      max_norm));
  ::torch::NoGradGuard no_grad;
  // Summed where the gradients are, read back once (a GPU would sync per unit otherwise).
  ::torch::Tensor sum = ::torch::zeros({}, ::torch::TensorOptions().dtype(::torch::kDouble).device(st.shard_device()));
  for (const auto& p : parameters()) sum += p.grad().to(::torch::kDouble).square().sum();
  const double squares = sum.item<double>();
  const double norm = std::sqrt(allreduce_scalar(*group_, squares, ReduceOp::Sum));
  const double coef = max_norm / (norm + 1e-6);  // as torch.nn.utils.clip_grad_norm_
  if (coef < 1)
    for (const auto& p : parameters()) p.grad().mul_(coef);
  return norm;
}

FsdpMemory FullyShardedDataParallel::memory() const {
  const State& st = *state_;
  FsdpMemory m;
  for (const auto& u : st.units) {
    if (u.count == 0) continue;
    m.params += u.used;
    m.padded += u.count;
    m.shard += u.chunk;
    m.units += 1;
    m.largest_unit = std::max(m.largest_unit, u.count);
    m.shard_bytes += u.chunk_bytes();
  }
  m.grad_shard_bytes = m.shard_bytes;
  m.gather_bytes = st.slots.size() * st.slot_bytes + st.root_bytes;
  return m;
}

std::vector<std::string> FullyShardedDataParallel::unit_names() const {
  std::vector<std::string> out;
  for (const auto& u : state_->units) out.push_back(u.name);
  return out;
}

// ---- State ----

namespace {

// "fsdp.layout": int64 [world, units, then per unit: elements without padding, with padding].
struct FsdpLayout {
  int world = 1;
  std::vector<std::pair<size_t, size_t>> units;  // (used, count)

  NamedTensor encode() const {
    std::vector<int64_t> v{world, static_cast<int64_t>(units.size())};
    for (const auto& [used, count] : units) {
      v.push_back(static_cast<int64_t>(used));
      v.push_back(static_cast<int64_t>(count));
    }
    return make_tensor("fsdp.layout", {static_cast<int64_t>(v.size())}, v);
  }
  static FsdpLayout decode(const std::map<std::string, const NamedTensor*>& rank0, const char* who) {
    const auto it = rank0.find("fsdp.layout");
    if (it == rank0.end() || it->second->dtype != DType::I64)
      throw InvalidArgument(fmt::format("{}: rank 0's shard has no int64 \"fsdp.layout\": it was not written by "
                                        "FullyShardedDataParallel (state_shard or optimizer_state_shard)",
                                        who));
    std::vector<int64_t> v(it->second->numel());
    std::memcpy(v.data(), it->second->bytes.data(), v.size() * sizeof(int64_t));
    if (v.size() < 2 || v[0] < 1 || v[1] < 0 || static_cast<size_t>(v[1]) * 2 + 2 != v.size())
      throw InvalidArgument(fmt::format("{}: \"fsdp.layout\" is malformed ({} values)", who, v.size()));
    FsdpLayout l{.world = static_cast<int>(v[0]), .units = {}};
    for (size_t u = 0; u < static_cast<size_t>(v[1]); ++u) {
      const size_t used = static_cast<size_t>(v[2 + 2 * u]), count = static_cast<size_t>(v[3 + 2 * u]);
      if (count % static_cast<size_t>(l.world) != 0 || used > count)
        throw InvalidArgument(fmt::format("{}: \"fsdp.layout\" is damaged: unit {} has {} elements padded to {}, which "
                                          "must be at least as many and a multiple of the world size {}",
                                          who, u, used, count, l.world));
      l.units.emplace_back(used, count);
    }
    return l;
  }
  // Unit u's elements per saving rank.
  int64_t chunk(size_t u) const { return static_cast<int64_t>(units[u].second) / world; }
  // Throws unless the saved units are this model's.
  template <class U>
  void check_fits(const std::vector<U>& mine, const char* who) const {
    if (units.size() != mine.size())
      throw InvalidArgument(fmt::format("{}: the checkpoint has {} FSDP units, this model {} (the root included): "
                                        "another model or another wrapping. HINT: resume with the model and FsdpUnit "
                                        "wrapping it was saved with, or save and load full_state()",
                                        who, units.size(), mine.size()));
    for (size_t u = 0; u < units.size(); ++u)
      if (units[u].first != mine[u].used)
        throw InvalidArgument(fmt::format("{}: {} holds {} elements in the checkpoint and {} in this model: another "
                                          "model or another wrapping. HINT: resume with the model it was saved with",
                                          who, unit_label(mine[u]), units[u].first, mine[u].used));
  }
};

FsdpLayout layout_of(const std::vector<Unit>& units, int world) {
  FsdpLayout l{.world = world, .units = {}};
  for (const auto& u : units) l.units.emplace_back(u.used, u.count);
  return l;
}

::torch::Tensor chunk_view(const Unit& u, std::byte* data, const ::torch::Device& device) {
  return wrap(data, {static_cast<int64_t>(u.chunk)}, ::torch::TensorOptions().dtype(u.type).device(device));
}

// Frozen parameters and buffers: FSDP keeps them whole on every rank, and
// rank 0's state_shard() saves them as "fsdp.whole.<name>".
constexpr std::string_view kWhole = "fsdp.whole.";
constexpr const char* kWholeCount = "fsdp.whole";  // int64 [count]: rank 0 wrote them (absent in older files)

// Whether a parameter is one FSDP shards (the others stay whole on every rank).
using IsSharded = std::function<bool(const ::torch::Tensor&)>;

// The module's frozen parameters and buffers, by name (a tied one under each of its names).
std::vector<std::pair<std::string, ::torch::Tensor>> whole_tensors(const ::torch::nn::Module& module,
                                                                   const IsSharded& sharded) {
  std::vector<std::pair<std::string, ::torch::Tensor>> out;
  for (const auto& item : module.named_parameters(true))
    if (!sharded(item.value())) out.emplace_back(item.key(), item.value());
  for (const auto& b : module.named_buffers(true)) out.emplace_back(b.key(), b.value());
  return out;
}

// Rank 0's part of state_shard(): the whole tensors and their count.
void append_whole(std::vector<NamedTensor>& out, const ::torch::nn::Module& module, const IsSharded& sharded) {
  const auto whole = whole_tensors(module, sharded);
  for (const auto& [name, t] : whole) out.push_back(to_named(std::string(kWhole) + name, t));
  out.push_back(make_tensor(kWholeCount, {1}, std::vector<int64_t>{static_cast<int64_t>(whole.size())}));
}

// What rank 0 saved of the module's whole tensors: (the module's tensor, the
// saved value) for each, checked first so that a load changes nothing when
// one is missing, extra or of another shape or dtype. Empty when the file
// has no "fsdp.whole" (written before they were saved): the module keeps its own.
std::vector<std::pair<::torch::Tensor, ::torch::Tensor>> saved_whole(const ::torch::nn::Module& module,
                                                                     const IsSharded& sharded,
                                                                     const std::map<std::string, const NamedTensor*>& rank0,
                                                                     const char* who) {
  std::vector<std::pair<::torch::Tensor, ::torch::Tensor>> out;
  if (!rank0.contains(kWholeCount)) return out;
  std::map<std::string, const NamedTensor*> saved;
  for (const auto& [name, t] : rank0)
    if (name.rfind(kWhole, 0) == 0) saved.emplace(name.substr(kWhole.size()), t);
  for (const auto& [name, mine] : whole_tensors(module, sharded)) {
    const auto it = saved.find(name);
    if (it == saved.end())
      throw InvalidArgument(fmt::format("{}: rank 0's shard has no \"{}{}\" for the model's frozen parameter or buffer "
                                        "'{}': another model (its frozen parameters and buffers differ)",
                                        who, kWhole, name, name));
    ::torch::Tensor t = from_named(*it->second);
    if (t.sizes() != mine.sizes() || t.scalar_type() != mine.scalar_type())
      throw InvalidArgument(fmt::format("{}: '{}' is {} {} in the checkpoint, {} {} in the model", who, name,
                                        c10::toString(t.scalar_type()), c10::str(t.sizes()),
                                        c10::toString(mine.scalar_type()), c10::str(mine.sizes())));
    out.emplace_back(mine, t);
    saved.erase(it);
  }
  if (!saved.empty())
    throw InvalidArgument(fmt::format("{}: the checkpoint has frozen parameters or buffers this model does not, e.g. "
                                      "'{}': another model",
      who, saved.begin()->first));
  return out;
}

}  // namespace

std::vector<NamedTensor> FullyShardedDataParallel::full_state() {
  State& st = *state_;
  st.check_usable();
  std::map<size_t, NamedTensor> trained;  // by parameter index
  for (size_t i = 0; i < st.units.size(); ++i) {
    const Unit& u = st.units[i];
    if (u.count == 0) continue;
    // The shards themselves (the master dtype under mixed precision), one unit at a time.
    ::torch::Tensor flat = ::torch::empty({static_cast<int64_t>(u.count)}, st.on_device(u.type));
    {
      // Under cpu_offload this rank's chunk goes up into its place first (an in-place allgather).
      void* mine = u.shard;
      if (st.offload) {
        ::torch::Tensor place = flat.narrow(0, static_cast<int64_t>(static_cast<size_t>(st.rank) * u.chunk), static_cast<int64_t>(u.chunk));
        place.copy_(st.shard_tensor(u.shard, u.chunk, u.type));
        mine = place.data_ptr();
      }
      CudaStreamScope scope(st.stream());  // after the last step
      st.wait(group_->allgather(Buffer{mine, u.chunk, u.dtype}, Buffer{flat.data_ptr(), u.count, u.dtype}));
    }
    for (size_t j = 0; j < u.params.size(); ++j) {
      const size_t p = u.params[j];
      trained.emplace(p, to_named(st.names[p], flat.narrow(0, static_cast<int64_t>(u.offsets[j]), st.params[p].numel())
                                                   .view(st.params[p].sizes())));
    }
  }
  std::vector<NamedTensor> out;
  for (const auto& item : module_->named_parameters(true)) {
    const auto it = st.index_of.find(item.value().unsafeGetTensorImpl());
    if (it == st.index_of.end()) {
      out.push_back(to_named(item.key(), item.value()));  // frozen: whole on every rank
    } else {
      NamedTensor t = trained.at(it->second);
      t.name = item.key();  // a tied parameter under each of its names
      out.push_back(std::move(t));
    }
  }
  for (const auto& b : module_->named_buffers(true)) out.push_back(to_named(b.key(), b.value()));
  return out;
}

void FullyShardedDataParallel::load_full_state(const std::vector<NamedTensor>& state) {
  constexpr const char* kWho = "FullyShardedDataParallel::load_full_state";
  State& st = *state_;
  st.check_usable();
  std::map<std::string, const NamedTensor*> by_name;
  for (const auto& t : state) by_name[t.name] = &t;
  const auto find = [&](const std::string& name, const char* kind, ::torch::IntArrayRef sizes, ::torch::ScalarType type) {
    const auto it = by_name.find(name);
    if (it == by_name.end())
      throw InvalidArgument(fmt::format("{}: the state has no tensor for {} '{}'; was it saved from another model?",
                                        kWho, kind, name));
    ::torch::Tensor t = from_named(*it->second);
    if (t.sizes() != sizes || t.scalar_type() != type)
      throw InvalidArgument(fmt::format("{}: '{}' is {} {} in the state, {} {} in the model", kWho, name,
                                        c10::toString(t.scalar_type()), c10::str(t.sizes()), c10::toString(type),
                                        c10::str(sizes)));
    return t;
  };
  // Everything staged first: a failure changes nothing.
  std::vector<::torch::Tensor> chunks(st.units.size());
  for (size_t i = 0; i < st.units.size(); ++i) {
    const Unit& u = st.units[i];
    if (u.count == 0) continue;
    ::torch::Tensor flat = ::torch::zeros({static_cast<int64_t>(u.count)}, ::torch::TensorOptions().dtype(u.type));
    for (size_t j = 0; j < u.params.size(); ++j) {
      const ::torch::Tensor& p = st.params[u.params[j]];
      flat.narrow(0, static_cast<int64_t>(u.offsets[j]), p.numel())
          .copy_(find(st.names[u.params[j]], "parameter", p.sizes(), u.type).reshape({-1}));
    }
    chunks[i] = flat.narrow(0, static_cast<int64_t>(st.rank) * static_cast<int64_t>(u.chunk), static_cast<int64_t>(u.chunk));
  }
  std::vector<std::pair<::torch::Tensor, ::torch::Tensor>> whole;  // frozen parameters and buffers
  size_t known = 0;
  for (const auto& item : module_->named_parameters(true)) {
    ++known;
    if (!st.index_of.contains(item.value().unsafeGetTensorImpl()))
      whole.emplace_back(item.value(), find(item.key(), "frozen parameter", item.value().sizes(), item.value().scalar_type()));
  }
  for (const auto& b : module_->named_buffers(true)) {
    ++known;
    whole.emplace_back(b.value(), find(b.key(), "buffer", b.value().sizes(), b.value().scalar_type()));
  }
  if (by_name.size() > known) {
    std::set<std::string> ours;
    for (const auto& item : module_->named_parameters(true)) ours.insert(item.key());
    for (const auto& b : module_->named_buffers(true)) ours.insert(b.key());
    std::string extra;
    for (const auto& [name, t] : by_name)
      if (!ours.contains(name)) extra += (extra.empty() ? "" : ", ") + name;
    throw InvalidArgument(fmt::format("{}: the state has tensors the model does not: {}", kWho, extra));
  }
  ::torch::NoGradGuard no_grad;
  st.sync_with_stream();  // no queued gather still reads the shards
  for (size_t i = 0; i < st.units.size(); ++i)
    if (chunks[i].defined()) chunk_view(st.units[i], st.units[i].shard, st.shard_device()).copy_(chunks[i]);
  for (auto& [to, from] : whole) to.copy_(from);
  for (size_t i = 0; i < st.units.size(); ++i) st.release(i);
  st.open = false;  // the root is gathered anew by the next pre_forward()
}

std::vector<NamedTensor> FullyShardedDataParallel::state_shard() const {
  const State& st = *state_;
  std::vector<NamedTensor> out;
  for (size_t i = 0; i < st.units.size(); ++i)
    if (st.units[i].chunk > 0) out.push_back(to_named(fmt::format("fsdp.unit{}", i), chunk_view(st.units[i], st.units[i].shard, st.shard_device())));
  out.push_back(layout_of(st.units, st.n).encode());
  if (st.rank == 0)  // whole on every rank: rank 0's (the buffers broadcast_buffers spreads) are saved
    append_whole(out, *module_, [&st](const ::torch::Tensor& p) { return st.index_of.contains(p.unsafeGetTensorImpl()); });
  return out;
}

void FullyShardedDataParallel::load_state_shards(const std::function<std::vector<NamedTensor>(int rank)>& read) {
  constexpr const char* kWho = "FullyShardedDataParallel::load_state_shards";
  State& st = *state_;
  st.check_usable();
  shard::ShardFiles files(read);
  const FsdpLayout lay = FsdpLayout::decode(files.get(0), kWho);
  lay.check_fits(st.units, kWho);
  if (files.get(0).contains("fsdp.optimizer"))
    throw InvalidArgument(fmt::format("{}: these files hold optimizer state (optimizer_state_shard()); HINT: load them "
                                      "with load_optimizer_state_shards(), and the model's (state_shard()) with this",
                                      kWho));
  std::vector<::torch::Tensor> staged(st.units.size());
  for (size_t i = 0; i < st.units.size(); ++i) {
    const Unit& u = st.units[i];
    if (u.chunk == 0) continue;
    staged[i] = files.rechunk(fmt::format("fsdp.unit{}", i), u.type, st.rank, u.chunk, u.used, lay.chunk(i), kWho);
  }
  const auto whole = saved_whole(
      *module_, [&st](const ::torch::Tensor& p) { return st.index_of.contains(p.unsafeGetTensorImpl()); }, files.get(0),
      kWho);
  ::torch::NoGradGuard no_grad;
  st.sync_with_stream();  // no queued gather still reads the shards
  for (size_t i = 0; i < st.units.size(); ++i)
    if (staged[i].defined()) chunk_view(st.units[i], st.units[i].shard, st.shard_device()).copy_(staged[i]);
  for (const auto& [to, from] : whole) to.copy_(from);
  for (size_t i = 0; i < st.units.size(); ++i) st.release(i);
  st.open = false;
}

namespace {

// Rank 0's "fsdp.optimizer": the optimizer kind and its step. Throws, with `hint`, when the files hold none.
std::array<int64_t, 2> optimizer_head(const std::map<std::string, const NamedTensor*>& rank0, const char* who,
                                      const char* hint) {
  const auto it = rank0.find("fsdp.optimizer");
  if (it == rank0.end() || it->second->dtype != DType::I64 || it->second->numel() != 2)
    throw InvalidArgument(fmt::format("{}: rank 0's shard has no \"fsdp.optimizer\": {}", who, hint));
  std::array<int64_t, 2> head{};
  std::memcpy(head.data(), it->second->bytes.data(), sizeof(head));
  return head;
}

// What the optimizer steps of each unit's chunk, in chunk order, with the
// lengths: the unit's shard (an optimizer over parameters(), one group, in
// their order) or its runs (one over parameter_groups()). InvalidArgument for
// any other optimizer, one whose state FSDP does not know, and SGD groups
// that mix momentum with none (the ranks could not agree which state
// fields their files hold).
std::vector<std::vector<std::pair<::torch::Tensor, size_t>>> optimizer_chunks(
    ::torch::optim::Optimizer& o, const std::vector<Unit>& units,
    const std::vector<std::vector<std::pair<::torch::Tensor, size_t>>>& runs, const char* who) {
  if (!dynamic_cast<::torch::optim::SGD*>(&o) && !dynamic_cast<::torch::optim::Adam*>(&o) &&
      !dynamic_cast<::torch::optim::AdamW*>(&o))
    throw InvalidArgument(fmt::format("{}: the optimizer is none of SGD, Adam and AdamW, whose state FSDP knows how "
                                      "to cut into shards",
                                      who));
  const auto& groups = o.param_groups();
  std::vector<std::vector<std::pair<::torch::Tensor, size_t>>> out(units.size());
  std::vector<const void*> shards;
  for (size_t i = 0; i < units.size(); ++i)
    if (units[i].chunk > 0) {
      out[i].emplace_back(units[i].shard_param, units[i].chunk);
      shards.push_back(units[i].shard_param.unsafeGetTensorImpl());
    }
  bool over_shards = groups.size() == 1 && groups[0].params().size() == shards.size();
  for (size_t i = 0; over_shards && i < shards.size(); ++i)
    over_shards = groups[0].params()[i].unsafeGetTensorImpl() == shards[i];
  if (over_shards) return out;
  std::set<const void*> mine, theirs;
  for (const auto& unit_runs : runs)
    for (const auto& [t, len] : unit_runs) mine.insert(t.unsafeGetTensorImpl());
  size_t count = 0;
  for (const auto& g : groups)
    for (const auto& p : g.params()) {
      theirs.insert(p.unsafeGetTensorImpl());
      ++count;
    }
  if (runs.empty() || theirs != mine || count != mine.size())
    throw InvalidArgument(fmt::format("{}: the optimizer is not over this FSDP's parameters() (one param group, in "
                                      "their order) nor over its parameter_groups() (every tensor of them, once). "
                                      "HINT: build it as torch::optim::AdamW opt(fsdp.parameters(), ...)",
                                      who));
  if (dynamic_cast<::torch::optim::SGD*>(&o)) {
    size_t with = 0;
    for (const auto& g : groups) with += static_cast<const ::torch::optim::SGDOptions&>(g.options()).momentum() != 0;
    if (with != 0 && with != groups.size())
      throw InvalidArgument(fmt::format("{}: {} of the optimizer's {} SGD param groups have momentum and the others "
                                        "none; FSDP saves the state of groups alike. HINT: give every group momentum, "
                                        "or none",
                                        who, with, groups.size()));
  }
  return runs;
}

}  // namespace

std::vector<NamedTensor> FullyShardedDataParallel::optimizer_state_shard(::torch::optim::Optimizer& optimizer) const {
  const State& st = *state_;
  const auto chunks = optimizer_chunks(optimizer, st.units, st.runs, "FullyShardedDataParallel::optimizer_state_shard");
  // The fields to save, alike on every rank: every run keeps state once the
  // optimizer has stepped (SGD groups do not mix momentum and none).
  const auto fields = shard::saved_fields(optimizer, !optimizer.state().empty());
  std::vector<NamedTensor> out;
  int64_t steps = 0;
  for (size_t i = 0; i < st.units.size(); ++i) {
    if (st.units[i].chunk == 0) continue;
    const shard::ShardState s = shard::chunk_state(optimizer, chunks[i], fields, st.units[i].type, st.shard_device());
    steps = std::max(steps, s.step);
    for (const auto& [field, t] : s.fields) out.push_back(to_named(fmt::format("fsdp.unit{}.{}", i, field), t));
  }
  out.push_back(layout_of(st.units, st.n).encode());
  out.push_back(make_tensor("fsdp.optimizer", {2}, std::vector<int64_t>{shard::kind_of(optimizer), steps}));
  return out;
}

void FullyShardedDataParallel::load_optimizer_state_shards(::torch::optim::Optimizer& optimizer,
                                                           const std::function<std::vector<NamedTensor>(int rank)>& read) {
  constexpr const char* kWho = "FullyShardedDataParallel::load_optimizer_state_shards";
  const State& st = *state_;
  const auto chunks = optimizer_chunks(optimizer, st.units, st.runs, kWho);
  shard::ShardFiles files(read);
  const auto& first = files.get(0);
  const FsdpLayout lay = FsdpLayout::decode(first, kWho);
  lay.check_fits(st.units, kWho);
  const auto head =
      optimizer_head(first, kWho, "it holds no optimizer state (written by state_shard(), not optimizer_state_shard()?)");
  const shard::Kind kind = shard::kind_of(optimizer);
  if (head[0] != kind)
    throw InvalidArgument(fmt::format("{}: the checkpoint holds {} state, this optimizer is {}; HINT: resume with the "
                                      "optimizer it was written with",
                                      kWho, head[0] >= 0 && head[0] <= 2 ? shard::kKindNames[head[0]] : "unknown",
                                      shard::kKindNames[kind]));
  std::vector<std::pair<::torch::Tensor, shard::ShardState>> staged;
  for (size_t i = 0; i < st.units.size(); ++i) {
    const Unit& u = st.units[i];
    if (u.chunk == 0) continue;
    shard::ShardState s{.fields = {}, .step = head[1]};
    const std::string prefix = fmt::format("fsdp.unit{}.", i);
    for (const auto& [name, t] : first)
      if (name.rfind(prefix, 0) == 0)
        s.fields.emplace_back(name.substr(prefix.size()),
                              files.rechunk(name, u.type, st.rank, u.chunk, u.used, lay.chunk(i), kWho).to(st.shard_device()));
    std::vector<shard::ShardState> parts = shard::split_state(s, chunks[i]);  // by param group, if cut
    for (size_t k = 0; k < parts.size(); ++k) staged.emplace_back(chunks[i][k].first, std::move(parts[k]));
  }
  for (auto& [p, s] : staged) shard::install_state(optimizer, p, kind, s);
}

// ---- Between FSDP's shards and a plain model's state ----

namespace {

// The units FullyShardedDataParallel makes of `module` (as its constructor
// finds them, without its checks): the root first, then every FsdpUnit in
// module order; in each, the trainable parameters in registration order, a
// tensor that appears twice taken once. No group and no sharding: for a
// model that is not wrapped (DDP, one process).
struct PlainUnit {
  std::string name;
  std::vector<::torch::Tensor> params;
  std::vector<size_t> offsets;
  size_t used = 0;
  ::torch::ScalarType type = ::torch::kFloat;
};

std::vector<PlainUnit> plain_units(const ::torch::nn::Module& module) {
  std::vector<PlainUnit> units(1);
  for (const auto& item : module.named_modules("", /*include_self=*/false))
    if (dynamic_cast<const FsdpUnitBase*>(item.value().get())) units.push_back(PlainUnit{.name = item.key()});
  std::set<const void*> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const ::torch::Tensor& p = item.value();
    if (!p.requires_grad() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    PlainUnit& u = units[unit_for(item.key(), units)];
    u.type = p.scalar_type();
    u.params.push_back(p);
    u.offsets.push_back(u.used);
    u.used += static_cast<size_t>(p.numel());
  }
  return units;
}

// The index of every trainable parameter of `module` in a plain optimizer
// over its parameters() (registration order, each appearance counted), by tensor.
std::multimap<const void*, size_t> plain_indices(const ::torch::nn::Module& module) {
  std::multimap<const void*, size_t> out;
  size_t i = 0;
  for (const auto& p : module.parameters(/*recurse=*/true))
    if (p.requires_grad()) out.emplace(p.unsafeGetTensorImpl(), i++);
  return out;
}

}  // namespace

std::vector<NamedTensor> fsdp_state_to_full(const ::torch::nn::Module& module,
                                            const std::function<std::vector<NamedTensor>(int rank)>& read) {
  constexpr const char* kWho = "fsdp_state_to_full";
  shard::ShardFiles files(read);
  const FsdpLayout lay = FsdpLayout::decode(files.get(0), kWho);
  const std::vector<PlainUnit> units = plain_units(module);
  lay.check_fits(units, kWho);
  if (files.get(0).contains("fsdp.optimizer"))
    throw InvalidArgument(fmt::format("{}: these files hold optimizer state (optimizer_state_shard()); HINT: convert "
                                      "them with fsdp_optimizer_state_to_full(), and the model's with this",
                                      kWho));
  std::map<const void*, ::torch::Tensor> value;  // by tensor: a tied parameter under each of its names
  for (size_t u = 0; u < units.size(); ++u) {
    if (units[u].used == 0) continue;
    const ::torch::Tensor whole = files.whole(fmt::format("fsdp.unit{}", u), lay.world, lay.chunk(u), units[u].type, kWho);
    for (size_t j = 0; j < units[u].params.size(); ++j) {
      const ::torch::Tensor& p = units[u].params[j];
      value[p.unsafeGetTensorImpl()] = whole.narrow(0, static_cast<int64_t>(units[u].offsets[j]), p.numel()).view(p.sizes());
    }
  }
  // Frozen parameters and buffers: rank 0's saved ones, or (files without them) the module's own.
  const auto trained = [](const ::torch::Tensor& p) { return p.requires_grad(); };  // as FSDP's constructor shards
  for (const auto& [mine, saved] : saved_whole(module, trained, files.get(0), kWho)) value[mine.unsafeGetTensorImpl()] = saved;
  std::vector<NamedTensor> out;
  for (const auto& item : module.named_parameters(true)) {
    const auto it = value.find(item.value().unsafeGetTensorImpl());
    out.push_back(to_named(item.key(), it != value.end() ? it->second : item.value()));
  }
  for (const auto& b : module.named_buffers(true)) {
    const auto it = value.find(b.value().unsafeGetTensorImpl());
    out.push_back(to_named(b.key(), it != value.end() ? it->second : b.value()));
  }
  return out;
}

std::vector<NamedTensor> fsdp_optimizer_state_to_full(const ::torch::nn::Module& module,
                                                      const std::function<std::vector<NamedTensor>(int rank)>& read) {
  constexpr const char* kWho = "fsdp_optimizer_state_to_full";
  shard::ShardFiles files(read);
  const auto& first = files.get(0);
  const FsdpLayout lay = FsdpLayout::decode(first, kWho);
  const std::vector<PlainUnit> units = plain_units(module);
  lay.check_fits(units, kWho);
  const auto head = optimizer_head(
      first, kWho, "it holds the model (state_shard()), not optimizer state; HINT: convert it with fsdp_state_to_full()");
  const auto index = plain_indices(module);
  std::vector<NamedTensor> out;
  std::set<size_t> stepped;
  for (size_t u = 0; u < units.size(); ++u) {
    const std::string prefix = fmt::format("fsdp.unit{}.", u);
    for (const auto& [name, t] : first) {
      if (name.rfind(prefix, 0) != 0 || units[u].used == 0) continue;
      const ::torch::Tensor whole = files.whole(name, lay.world, lay.chunk(u), from_named(*t).scalar_type(), kWho);
      for (size_t j = 0; j < units[u].params.size(); ++j) {
        const ::torch::Tensor& p = units[u].params[j];
        const auto v = whole.narrow(0, static_cast<int64_t>(units[u].offsets[j]), p.numel()).view(p.sizes());
        const auto [lo, hi] = index.equal_range(p.unsafeGetTensorImpl());
        for (auto k = lo; k != hi; ++k) {
          out.push_back(to_named(fmt::format("group0.param{}.{}", k->second, name.substr(prefix.size())), v));
          stepped.insert(k->second);
        }
      }
    }
  }
  if (head[0] != shard::kSgd)
    for (size_t i : stepped) out.push_back(to_named(fmt::format("group0.param{}.step", i), ::torch::tensor(head[1], ::torch::kLong)));
  return out;
}

void FullyShardedDataParallel::load_full_optimizer_state(::torch::optim::Optimizer& optimizer,
                                                         const std::vector<NamedTensor>& full) {
  constexpr const char* kWho = "FullyShardedDataParallel::load_full_optimizer_state";
  const State& st = *state_;
  (void)optimizer_chunks(optimizer, st.units, st.runs, kWho);  // checked before any work
  const shard::Kind kind = shard::kind_of(optimizer);
  const auto index = plain_indices(*module_);
  // By position (one group), or by parameter name (any groups: tp::full_optimizer_state).
  const std::vector<NamedTensor> positional = shard::plain_state_by_position(full, shard::trainable_places(*module_), kWho);
  const shard::PlainState plain = shard::parse_plain_state(positional, index.size(), kind, kWho);
  // One shard of a world of 1 (no padding), which load_optimizer_state_shards cuts to this world.
  FsdpLayout layout{.world = 1, .units = {}};
  std::vector<NamedTensor> shard;
  for (size_t u = 0; u < st.units.size(); ++u) {
    const Unit& unit = st.units[u];
    layout.units.emplace_back(unit.used, unit.used);
    std::map<std::string, ::torch::Tensor> fields;
    for (size_t j = 0; j < unit.params.size(); ++j) {
      const ::torch::Tensor& p = st.params[unit.params[j]];
      const auto at = index.find(p.unsafeGetTensorImpl());
      const auto found = at == index.end() ? plain.by_param.end() : plain.by_param.find(at->second);
      if (found == plain.by_param.end()) continue;  // not stepped yet: zeros
      for (const auto& [field, t] : found->second) {
        auto& flat = fields[field];
        if (!flat.defined()) flat = ::torch::zeros({static_cast<int64_t>(unit.used)}, ::torch::TensorOptions().dtype(unit.type));
        const ::torch::Tensor v = from_named(*t);
        if (v.numel() != p.numel() || v.scalar_type() != unit.type)
          throw InvalidArgument(fmt::format("{}: \"{}\" has {} elements of {}, its parameter '{}' {} of {}: another "
                                            "model",
                                            kWho, t->name, v.numel(), c10::toString(v.scalar_type()),
                                            st.names[unit.params[j]], p.numel(), c10::toString(unit.type)));
        flat.narrow(0, static_cast<int64_t>(unit.offsets[j]), v.numel()).copy_(v.reshape({-1}));
      }
    }
    for (const auto& [field, flat] : fields) shard.push_back(to_named(fmt::format("fsdp.unit{}.{}", u, field), flat));
  }
  shard.push_back(layout.encode());
  shard.push_back(make_tensor("fsdp.optimizer", {2}, std::vector<int64_t>{kind, plain.steps}));
  load_optimizer_state_shards(optimizer, [&](int) { return shard; });
}

}  // namespace cohort::torch
