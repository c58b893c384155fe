// Reducer: ready-tracking, bucket launch, finalize.
//
// State of one synced iteration (all under Impl::mu):
//   ready[p]        parameter p was marked (or, in finalize, treated as unused)
//   bucket.pending  parameters of the bucket not yet ready
//   next_launch     buckets [0, next_launch) have started their communication
// A bucket launches when its pending count reaches zero AND every earlier
// bucket has launched: launch order is plan order on every rank (see
// launch_ready_buckets for why). finalize() launches what is left (unused
// parameters), waits for each bucket in order, runs the hooks' `then`, and
// delivers the results.
//
// Threads: mark_ready may come from several autograd threads at once; the
// lock serialises them, and since collectives are issued only under the lock,
// the group sees one issuing thread at a time as it requires. A small
// collective may run inline on the marking thread (COHORT_INLINE_BYTES).
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <span>

#include "cohort/ddp.hpp"
#include "core/check.hpp"
#include "core/exception_text.hpp"
#include "core/log.hpp"
#include "ddp/iteration_record.hpp"
#include "ddp/messages.hpp"

namespace cohort::ddp {
namespace {

size_t mib_to_bytes(double mb, const char* what) {
  if (!(mb >= 0) || mb > 1e9)  // also rejects NaN
    throw InvalidArgument(fmt::format("ReducerOptions::{} is {}; it must be a size in MiB, >= 0", what, mb));
  return static_cast<size_t>(mb * 1024 * 1024);
}

bool happened(SteadyTime t) { return t.time_since_epoch().count() != 0; }

uint64_t fnv(uint64_t h, uint64_t v) {
  for (int i = 0; i < 8; ++i) h = (h ^ ((v >> (8 * i)) & 0xff)) * 1099511628211ull;
  return h;
}

}  // namespace

struct COHORT_HIDDEN Reducer::Impl {
  struct Bucket {
    std::byte* data = nullptr;  // the flat buffer, inside `storage`
    BucketScratch scratch;      // GradBucket::scratch
    std::vector<size_t> rows, counts;  // ParamSpec::rows and count of the bucket's parameters, in bucket order
    // grads_valid_until_finalize: the elements [direct_first, direct_end) the
    // group reads in place in allreduce_gathered, and this iteration's
    // gradients left there (InputPiece), by parameter, in marking order.
    size_t direct_first = 0, direct_end = 0;
    std::vector<InputPiece> pieces;
    // batch_copies: this iteration's gradients, copied in when the bucket launches.
    std::vector<GradMemory::Copy> copies;
    size_t pending = 0;
    CommFuture future;
    std::shared_ptr<std::byte[]> lease;  // recycled_buckets: the pool buffer `data` points into
    size_t used_end = 0;                 // elements owned by parameters; padding after them
  };

  ProcessGroup& group;
  const ReducerOptions opts;
  const std::shared_ptr<GradMemory> mem;  // opts.memory, or host memory
  // Gradients may be left where they are until finalize (pieces the group
  // reads in place): only when the group reads them as host memory.
  const bool leave_in_place;
  // Gradients in device memory that stay valid until finalize: each bucket's
  // are handed to the memory in one batch when it launches
  // (GradMemory::grads_to_buckets), rather than one copy per mark.
  const bool batch_copies;
  std::vector<ParamSpec> params;
  const BucketPlan plan;
  std::vector<Bucket> buckets;
  // Every bucket's buffer, 64-byte aligned, in one group.allocate_buffer():
  // on a single host that is shared memory the peers map once, so the
  // single-copy allreduce reduces straight out of their buckets.
  std::shared_ptr<std::byte[]> storage;
  // recycled_buckets: the buffers no bucket holds, how many there are in
  // all, each the largest bucket's size, and what every bucket's own buffer
  // takes (the pool is used only when K of its buffers take less).
  std::vector<std::shared_ptr<std::byte[]>> pool_free;
  size_t pool_count = 0, pool_each = 0, full_bytes = 0;
  bool pooled = false;
  std::vector<size_t> bucket_of, offset_of;  // by parameter
  CommHook hook;

  mutable std::mutex mu;
  bool open = false;  // a synced iteration began and was not finalized
  std::vector<char> ready;
  // find_unused_parameters: after finalize, 1 where some rank had a gradient
  // for the parameter this iteration (PyTorch's local_used_map, allreduced).
  std::vector<uint8_t> used_anywhere;
  size_t ready_count = 0;
  size_t next_launch = 0;
  size_t next_poll = 0;  // buckets before it were seen complete (collectives complete in issue order)
  int no_sync_depth = 0;
  size_t no_sync_marks = 0;
  uint64_t finalized = 0;
  IterationStats stats;
  std::string failed;  // non-empty: why this reducer can no longer be used
  // The last finalize()'s collectives that were still running when it
  // returned (GradMemory::wait ordered a GPU stream after them instead of
  // waiting): checked for errors when the next iteration begins, and their
  // buckets are never freed while one runs.
  std::vector<WorkPtr> unconfirmed;
  std::vector<GradMemory::Copy> results;  // finalize's copies of the results, reused

  Impl(ProcessGroup& g, std::vector<ParamSpec> ps, ReducerOptions o)
      : group(g),
        opts(std::move(o)),
        mem(opts.memory ? opts.memory : host_grad_memory()),
        leave_in_place(opts.grads_valid_until_finalize && opts.recycled_buckets == 0 && mem->buckets_on_host() &&
                       mem->grads_on_host()),
        batch_copies(opts.grads_valid_until_finalize && !mem->buckets_on_host()),
        params(std::move(ps)),
        plan(plan_buckets(params, {.cap_bytes = mib_to_bytes(opts.bucket_cap_mb, "bucket_cap_mb"),
                                   .first_cap_bytes = mib_to_bytes(opts.first_bucket_mb, "first_bucket_mb"),
                                   .count_multiple = opts.bucket_count_multiple})),
        buckets(plan.size()),
        bucket_of(params.size()),
        offset_of(params.size()),
        hook(opts.comm_hook ? opts.comm_hook : allreduce_avg_hook()),
        ready(params.size(), 0),
        used_anywhere(params.size(), 1) {
    check_recycling();
    std::vector<size_t> at(plan.size());
    size_t total = 0;
    for (size_t b = 0; b < plan.size(); ++b) {
      at[b] = total;
      total += (plan[b].bytes() + 63) / 64 * 64;
    }
    full_bytes = total;
    for (const PlannedBucket& b : plan) pool_each = std::max(pool_each, (b.bytes() + 63) / 64 * 64);
    // A model of few buckets (K of the largest take as much as all of them)
    // keeps one buffer per bucket: recycling would save nothing.
    pooled = recycling() && opts.recycled_buckets * pool_each < full_bytes;
    if (!pooled) storage = mem->allocate(group, total);
    for (size_t b = 0; b < plan.size(); ++b) {
      if (storage) buckets[b].data = storage.get() + at[b];  // (recycled_buckets: for good when not pooled)
      for (size_t k = 0; k < plan[b].params.size(); ++k) {
        bucket_of[plan[b].params[k]] = b;
        offset_of[plan[b].params[k]] = plan[b].offsets[k];
        buckets[b].used_end = std::max(buckets[b].used_end, plan[b].offsets[k] + params[plan[b].params[k]].count);
      }
      if (leave_in_place && plan[b].count > 0) {
        const auto [first, count] = group.allreduce_direct_block(plan[b].count, plan[b].dtype);
        buckets[b].direct_first = first;
        buckets[b].direct_end = first + count;
      }
    }
    reset_stats();
    if (core::log_enabled(core::LogLevel::Info, core::kDdp)) log_plan();
  }

  bool recycling() const { return opts.recycled_buckets > 0; }

  void check_recycling() const {
    if (!recycling()) return;
    const char* why = opts.gradient_as_bucket_view ? "gradient_as_bucket_view (a .grad cannot view a recycled buffer)"
                      : opts.on_reduced            ? "on_reduced (the hook is the results' only reader)"
                      : !opts.comm_hook            ? "the default hook (its averaged result would be dropped)"
                      : mem->buckets_on_host() != mem->grads_on_host()
                          ? "gradients staged between host buckets and device memory"
                          : nullptr;
    if (why)
      throw InvalidArgument(fmt::format("ReducerOptions::recycled_buckets = {} cannot be combined with {}; recycled "
                                        "buckets are for a comm hook that consumes each reduced bucket (ZeRO-2)",
                                        opts.recycled_buckets, why));
  }

  // recycled_buckets: gives bucket b a pool buffer (its padding zeroed), if
  // it has none. With K taken, or when one more would make the pool as large
  // as every bucket's own buffer, it first completes the oldest launched
  // bucket; the pool grows when none has launched.
  void acquire(size_t b) {
    Bucket& k = buckets[b];
    if (!pooled || k.data != nullptr || plan[b].count == 0) return;
    if (pool_free.empty()) {
      const size_t held = static_cast<size_t>(
          std::count_if(buckets.begin(), buckets.end(), [](const Bucket& x) { return x.lease != nullptr; }));
      const bool full = held >= opts.recycled_buckets || (pool_count + 1) * pool_each >= full_bytes;
      for (size_t o = 0; full && o < next_launch; ++o)
        if (buckets[o].lease) {
          complete(o);
          break;
        }
    }
    if (pool_free.empty()) {
      pool_free.push_back(mem->allocate(group, pool_each));
      ++pool_count;
    }
    k.lease = std::move(pool_free.back());
    pool_free.pop_back();
    k.data = k.lease.get();
    const size_t es = dtype_size(plan[b].dtype);
    if (plan[b].count > k.used_end) mem->zero_bucket(k.data + k.used_end * es, (plan[b].count - k.used_end) * es);
  }

  // Gives bucket b's pool buffer back, or leaks it while a collective may
  // still use it (a GradMemory whose wait only ordered a stream, an
  // abandoned iteration): it is never handed to another bucket under it.
  void release(size_t b) {
    Bucket& k = buckets[b];
    if (!k.lease) return;
    k.data = nullptr;
    if (k.future.work && !k.future.work->is_completed()) (void)new auto(std::move(k.lease));
    else pool_free.push_back(std::move(k.lease));
  }

  // Waits for bucket b's collective and runs its `then` (finalize's work for
  // one bucket); with recycled_buckets gives its buffer back.
  void complete(size_t b) {
    CommFuture& f = buckets[b].future;
    try {
      if (f.work) {
        mem->wait(*f.work, opts.timeout);
        if (!f.work->is_completed()) unconfirmed.push_back(f.work);
      }
      if (!happened(stats.buckets[b].completed)) stats.buckets[b].completed = std::chrono::steady_clock::now();
      if (f.then) f.then();
    } catch (const std::exception& e) {
      failed = fmt::format("rank {}: this reducer can no longer be used: bucket {} of iteration {} failed: {}",
                           group.rank(), b, stats.iteration, e.what());
      throw;
    }
    release(b);
    f = {};  // done: the destructor must not think it is still running
  }

  // INFO: the bucket plan, so a user can see how gradients are grouped
  // (bucket_cap_mb, first_bucket_mb) before asking why overlap is poor.
  void log_plan() const {
    size_t total = 0;
    for (const PlannedBucket& b : plan) total += b.bytes();
    COHORT_INFO(kDdp, "bucket plan: {} parameter(s), {:.2f} MiB of gradients in {} bucket(s) (cap {} MiB, first {} MiB)",
                params.size(), total / 1048576.0, plan.size(), opts.bucket_cap_mb, opts.first_bucket_mb);
    for (size_t b = 0; b < plan.size(); ++b) {
      const PlannedBucket& pb = plan[b];
      std::string first = pb.params.empty() ? "-" : params[pb.params.front()].name;
      std::string last = pb.params.empty() ? "-" : params[pb.params.back()].name;
      // Not a range: with several dtypes a bucket skips the other dtypes' parameters.
      COHORT_INFO(kDdp, "bucket {}: {} parameter(s), {} x {} ({:.2f} MiB), first {}, last {}", b, pb.params.size(),
                  dtype_name(pb.dtype), pb.count, pb.bytes() / 1048576.0, first, last);
    }
  }

  // Puts parameter p's gradient `src` into its slot (batch_copies: queues the
  // copy for the bucket's launch), except the part the group will read in
  // place (Bucket::direct_first..direct_end), which it records.
  void copy_to_slot(size_t p, const void* src, void* dst) {
    Bucket& bucket = buckets[bucket_of[p]];
    if (batch_copies) {
      queue_copy(p, src, dst);
      return;
    }
    const size_t es = dtype_size(params[p].dtype), a = offset_of[p], e = a + params[p].count;
    const size_t lo = std::max(a, bucket.direct_first), hi = std::min(e, bucket.direct_end);
    if (lo >= hi) {
      mem->grad_to_bucket(dst, src, param_bytes(p));
      return;
    }
    auto* d = static_cast<std::byte*>(dst);
    auto* from = static_cast<const std::byte*>(src);
    std::memcpy(d, from, (lo - a) * es);
    std::memcpy(d + (hi - a) * es, from + (hi - a) * es, (e - hi) * es);
    bucket.pieces.push_back({lo, hi - lo, from + (lo - a) * es});
  }

  // batch_copies: p's copy waits in its bucket for the launch, with the
  // memory's queue of the moment (the stream that wrote the gradient).
  void queue_copy(size_t p, const void* src, void* dst) {
    buckets[bucket_of[p]].copies.push_back({dst, src, param_bytes(p), mem->copy_queue()});
  }

  void* slot(size_t p) {
    return buckets[bucket_of[p]].data + offset_of[p] * dtype_size(params[p].dtype);
  }
  size_t param_bytes(size_t p) const { return params[p].count * dtype_size(params[p].dtype); }

  void check_param(size_t p, const char* call) const {
    if (p >= params.size())
      throw InvalidArgument(fmt::format("rank {}: Reducer::{}: parameter index {} is out of range; {} parameters are "
                                        "registered",
                                        group.rank(), call, p, params.size()));
  }
  void check_usable() const {
    if (!failed.empty()) throw Error(failed);
  }

  std::vector<size_t> unready() const {
    std::vector<size_t> out;
    for (size_t p = 0; p < params.size(); ++p)
      if (!ready[p]) out.push_back(p);
    return out;
  }

  // Every rank must register the same parameters and plan the same buckets,
  // or their collectives would not match; a cheap allgather of a signature
  // turns that mistake into a clear error at construction.
  void verify_across_ranks() {
    const int n = group.size();
    if (n == 1) return;
    uint64_t param_sig = 14695981039346656037ull, plan_sig = param_sig;
    size_t elements = 0;
    for (const ParamSpec& p : params) {
      param_sig = fnv(fnv(param_sig, p.count), static_cast<uint64_t>(p.dtype));
      elements += p.count;
    }
    for (const PlannedBucket& b : plan)
      plan_sig = fnv(fnv(fnv(plan_sig, b.count), static_cast<uint64_t>(b.dtype)), b.params.size());
    int64_t mine[4] = {static_cast<int64_t>(params.size()), static_cast<int64_t>(elements),
                       static_cast<int64_t>(param_sig), static_cast<int64_t>(plan_sig)};
    std::vector<int64_t> all(4 * static_cast<size_t>(n));
    host_collective({{mine, 4, DType::I64}, {all.data(), all.size(), DType::I64}}, [&](std::span<const Buffer> b) {
      return group.allgather(b[0], b[1], {.timeout = opts.timeout});
    });
    for (int r = 0; r < n; ++r)
      if (std::memcmp(&all[4 * static_cast<size_t>(r)], mine, sizeof mine) != 0)
        throw InvalidArgument(msg::params_differ(group.rank(), r, mine, &all[4 * static_cast<size_t>(r)]));
  }

  // A collective on small host data (int64 signatures, the used map), run
  // through bucket memory when the group moves device memory only (nccl).
  void host_collective(std::initializer_list<Buffer> host,
                       const std::function<WorkPtr(std::span<const Buffer>)>& issue) {
    if (mem->buckets_on_host()) {
      std::vector<Buffer> bufs(host);
      issue(bufs)->wait(opts.timeout);
      return;
    }
    std::vector<Buffer> bufs;
    std::vector<std::shared_ptr<std::byte[]>> keep;
    for (const Buffer& h : host) {
      keep.push_back(mem->allocate(group, std::max<size_t>(h.bytes(), 1)));
      mem->host_to_bucket(keep.back().get(), h.data, h.bytes());
      bufs.push_back({keep.back().get(), h.count, h.dtype});
    }
    try {
      issue(bufs)->wait(opts.timeout);
    } catch (...) {
      // The collective may still write into these (a timeout, a failed
      // peer): never hand them back to the allocator under it.
      (void)new std::vector<std::shared_ptr<std::byte[]>>(std::move(keep));
      throw;
    }
    size_t i = 0;
    for (const Buffer& h : host) mem->bucket_to_host(h.data, bufs[i++].data, h.bytes());
  }

  void reset_stats() {
    stats = IterationStats{.iteration = finalized, .no_sync_marks = no_sync_marks};
    for (size_t b = 0; b < plan.size(); ++b)
      stats.buckets.push_back(BucketStats{.index = b, .bytes = plan[b].bytes(), .params = plan[b].params.size()});
  }

  // Throws the failure of a collective that finalize() did not wait for on
  // the host; forgets those that completed.
  void check_unconfirmed() {
    for (auto it = unconfirmed.begin(); it != unconfirmed.end();) {
      if (std::exception_ptr e = (*it)->error()) {
        failed = fmt::format("rank {}: this reducer can no longer be used: {} of iteration {} failed after "
                             "backward() had returned (its gradients were wrong): {}",
                             group.rank(), (*it)->describe(), stats.iteration, core::exception_text(e));
        throw Error(failed);
      }
      it = (*it)->is_completed() ? unconfirmed.erase(it) : it + 1;
    }
  }

  void begin_iteration() {
    check_unconfirmed();
    open = true;
    std::fill(ready.begin(), ready.end(), 0);
    ready_count = 0;
    next_launch = next_poll = 0;
    for (size_t b = 0; b < buckets.size(); ++b) {
      Bucket& k = buckets[b];
      release(b);  // recycled_buckets: a buffer left by an abandoned iteration
      k.pending = plan[b].params.size();
      k.future = {};
      k.pieces.clear();
      k.copies.clear();
    }
    reset_stats();
    stats.started = std::chrono::steady_clock::now();
    no_sync_marks = 0;
  }

  void set_ready(size_t p) {
    ready[p] = 1;
    ++ready_count;
    const size_t b = bucket_of[p];
    if (--buckets[b].pending == 0) stats.buckets[b].ready = std::chrono::steady_clock::now();
  }

  // Launches complete buckets in plan order, stopping at the first incomplete
  // one. Why not launch each bucket the moment it completes: collectives on a
  // group match across ranks by issue order, not by content. Ranks can finish
  // buckets in different orders (autograd's thread scheduling, data-dependent
  // control flow), and if rank 0 issued bucket 1 then bucket 0 while rank 1
  // issued 0 then 1, their first allreduces would pair bucket 1 with bucket 0:
  // a desync error if the sizes differ, silently mixed gradients if they are
  // equal. The plan is the one order every rank agrees on (PyTorch does the same).
  void launch_ready_buckets(bool in_finalize) {
    while (next_launch < buckets.size() && buckets[next_launch].pending == 0) launch(next_launch++, in_finalize);
  }

  void launch(size_t b, bool in_finalize) {
    BucketStats& st = stats.buckets[b];
    st.launched = std::chrono::steady_clock::now();
    st.marks_at_launch = static_cast<long>(stats.marks);
    st.launched_in_finalize = in_finalize;
    if (plan[b].count == 0) {  // nothing to reduce; every rank skips it alike
      st.completed = st.launched;
      return;
    }
    Bucket& bucket = buckets[b];
    std::sort(bucket.pieces.begin(), bucket.pieces.end(),
              [](const InputPiece& x, const InputPiece& y) { return x.offset < y.offset; });
    bucket.rows.clear();  // (the plan may be rebuilt after the first iteration)
    bucket.counts.clear();
    for (size_t p : plan[b].params) {
      bucket.rows.push_back(params[p].rows);
      bucket.counts.push_back(params[p].count);
    }
    // Buckets without elements never reach the hook: the last one that does
    // is the one is_last() names (hooks end their iteration there).
    size_t hooked = plan.size();
    while (hooked > 0 && plan[hooked - 1].count == 0) --hooked;
    GradBucket gb(b, hooked, Buffer{bucket.data, plan[b].count, plan[b].dtype}, group, opts.timeout,
                  plan[b].params, *mem, bucket.scratch, &bucket.pieces, plan[b].offsets, bucket.counts, bucket.rows);
    if (!bucket.copies.empty()) {
      try {
        mem->grads_to_buckets(bucket.copies);  // each on its mark's queue, all ordered before the hook's collective
        bucket.copies.clear();
      } catch (const std::exception& e) {
        failed = fmt::format("rank {}: this reducer can no longer be used: copying the gradients into bucket {} of "
                             "iteration {} failed, and its collective was never issued: {}",
                             group.rank(), b, stats.iteration, e.what());
        throw;
      }
    }
    try {
      bucket.future = hook(gb);
      (void)gb.buffer();  // a hook that used neither buffer() nor allreduce() still gets every gradient in place
      if (recycling() && bucket.future.next)
        throw InvalidArgument("the hook returned CommFuture::next, and ReducerOptions::recycled_buckets needs hooks "
                              "of one step (a bucket's memory is given back after its `then`)");
    } catch (const std::exception& e) {
      // The hook may have issued some collectives: the ranks no longer agree.
      failed = fmt::format("rank {}: this reducer can no longer be used: its comm hook failed on bucket {} of "
                           "iteration {}: {}",
                           group.rank(), b, stats.iteration, e.what());
      throw;
    }
  }

  // Hooks of several steps (CommFuture::next): one step of every bucket per
  // round, in bucket order, so that every rank issues them alike.
  void run_next_steps() {
    for (bool more = true; more;) {
      more = false;
      for (size_t b = 0; b < buckets.size(); ++b) {
        CommFuture& f = buckets[b].future;
        if (!f.next) continue;
        try {
          // Decided alike on every rank (not by whether a GPU happened to finish already).
          if (!mem->buckets_on_host())
            throw InvalidArgument("a comm hook returned CommFuture::next for a bucket in device memory; its next "
                                  "step needs the work completed on the host: next is for host buckets");
          if (f.work) mem->wait(*f.work, opts.timeout);
          CommFuture following = f.next();
          f = std::move(following);
        } catch (const std::exception& e) {
          failed = fmt::format("rank {}: this reducer can no longer be used: bucket {} of iteration {} failed in its "
                               "comm hook's next step: {}",
                               group.rank(), b, stats.iteration, e.what());
          throw;
        }
        more = more || static_cast<bool>(f.next);
      }
    }
  }

  void poll_completions() {
    for (; next_poll < next_launch; ++next_poll) {
      const WorkPtr& w = buckets[next_poll].future.work;
      if (w && !w->is_completed()) break;
      if (!happened(stats.buckets[next_poll].completed))
        stats.buckets[next_poll].completed = std::chrono::steady_clock::now();
    }
  }

  void mark_ready(size_t p, const void* grad) {
    check_param(p, "mark_ready");
    if (no_sync_depth > 0) {
      ++no_sync_marks;
      return;
    }
    check_usable();
    if (open && ready_count == params.size())
      throw Error(msg::prior_iteration(group.rank(), stats.iteration, params, {}));
    if (!open) begin_iteration();
    if (ready[p]) throw Error(msg::marked_twice(group.rank(), stats.iteration, params, p));
    if (recycling()) acquire(bucket_of[p]);
    void* dst = slot(p);
    const void* src = grad ? grad : opts.gradient_as_bucket_view ? dst : recycling() ? nullptr : params[p].grad;
    if (src == nullptr && recycling()) {
      if (param_bytes(p) > 0) mem->zero_bucket(dst, param_bytes(p));
      src = dst;
    }
    if (src == nullptr && params[p].count > 0)
      throw InvalidArgument(fmt::format("rank {}: mark_ready({}): no gradient given for parameter {} and none is "
                                        "registered; pass its gradient's data pointer, or register it with set_grad()",
                                        group.rank(), p, msg::param_list(params, {p})));
    if (src != dst && param_bytes(p) > 0) copy_to_slot(p, src, dst);
    if (stats.marks++ == 0) stats.first_mark = std::chrono::steady_clock::now();
    set_ready(p);
    launch_ready_buckets(false);
    poll_completions();
  }

  bool finalize() {
    if (no_sync_depth > 0) return false;
    check_usable();
    // No parameter marked: no backward ran since the last finalize() (or only
    // a forward did), so there is nothing to reduce, as in PyTorch, where
    // finalization is queued by the first autograd hook.
    if (!open || ready_count == 0) {
      open = false;
      return false;
    }
    std::vector<size_t> unused = unready();
    // Which parameters had a gradient here (marked, or accumulated under
    // no_sync): every rank sends its map with the buckets, so that a
    // parameter no rank used can keep "no gradient" (the optimizer skips it).
    std::vector<uint8_t> used(params.size(), 1);
    for (size_t p : unused) used[p] = params[p].grad != nullptr;
    if (!unused.empty()) {
      if (!opts.find_unused_parameters) {
        std::string m = msg::unready_at_finalize(group.rank(), stats.iteration, params, unused);
        failed = msg::prior_iteration(group.rank(), stats.iteration, params, unused);
        throw Error(m);
      }
      // An unused parameter contributes its registered gradient: under
      // no_sync it may hold gradients accumulated in earlier passes. In plan
      // order, each bucket launched as soon as it is complete, so that
      // recycled buckets reuse the buffers of those already reduced.
      std::stable_sort(unused.begin(), unused.end(), [&](size_t x, size_t y) { return bucket_of[x] < bucket_of[y]; });
      for (size_t p : unused) {
        if (recycling()) acquire(bucket_of[p]);
        void* dst = slot(p);
        const void* src = params[p].grad;
        const size_t bytes = param_bytes(p);
        if (bytes > 0 && src == nullptr)
          mem->zero_bucket(dst, bytes);
        else if (bytes > 0 && src != dst && batch_copies)
          queue_copy(p, src, dst);
        else if (bytes > 0 && src != dst)
          mem->grad_to_bucket(dst, src, bytes);
        set_ready(p);
        launch_ready_buckets(true);
      }
      stats.unused_params = unused.size();
    }
    COHORT_ASSERT(next_launch == buckets.size(), "finalize: every bucket is complete but not every bucket launched");
    stats.wait_started = std::chrono::steady_clock::now();
    if (opts.find_unused_parameters && !params.empty()) {
      try {
        host_collective({{used.data(), used.size(), DType::U8}}, [&](std::span<const Buffer> b) {
          return group.allreduce(b[0], {.op = ReduceOp::Max, .timeout = opts.timeout});
        });
      } catch (const std::exception& e) {
        failed = fmt::format("rank {}: this reducer can no longer be used: exchanging which parameters were used in "
                             "iteration {} failed: {}",
                             group.rank(), stats.iteration, e.what());
        throw;
      }
      used_anywhere = std::move(used);
    }

    run_next_steps();
    for (size_t b = 0; b < buckets.size(); ++b) complete(b);

    // The iteration is complete on every rank; close it before handing
    // results out, so that a throwing on_reduced cannot leave it open.
    open = false;
    ++finalized;
    if (!opts.gradient_as_bucket_view && !recycling()) {
      results.clear();
      for (size_t p = 0; p < params.size(); ++p) {
        void* result = slot(p);
        if (opts.on_reduced)
          opts.on_reduced(p, result);
        else if (params[p].grad != nullptr && params[p].grad != result && param_bytes(p) > 0)
          results.push_back({params[p].grad, result, param_bytes(p)});
      }
      try {
        if (!results.empty()) mem->buckets_to_grads(results);
      } catch (const std::exception& e) {
        failed = fmt::format("rank {}: this reducer can no longer be used: copying the results of iteration {} back "
                             "into the gradients failed (some may hold the average, some not): {}",
                             group.rank(), stats.iteration, e.what());
        throw;
      }
    }
    stats.finalized = std::chrono::steady_clock::now();
    record_iteration(stats, group);  // timeline spans and step metrics (iteration_record.hpp)
    return true;
  }
};

Reducer::Reducer(ProcessGroup& group, std::vector<ParamSpec> params, ReducerOptions opts)
    : impl_(std::make_unique<Impl>(group, std::move(params), std::move(opts))) {
  impl_->verify_across_ranks();
}

Reducer::~Reducer() {
  // A failed finalize, or one that only ordered a GPU stream after its
  // collectives (unconfirmed), can leave collectives running on bucket
  // memory; freeing it would let them write into whatever is allocated there
  // next. Leak those buffers instead (after an error, which ends the job
  // anyway, or when the caller drops DDP before its GPU work completed).
  bool running = false;
  for (const WorkPtr& w : impl_->unconfirmed) running = running || !w->is_completed();
  for (const Impl::Bucket& b : impl_->buckets) running = running || (b.future.work && !b.future.work->is_completed());
  if (!running) return;
  for (Impl::Bucket& b : impl_->buckets) {
    (void)new BucketScratch(std::move(b.scratch));
    if (b.lease) (void)new std::shared_ptr<std::byte[]>(std::move(b.lease));
  }
  (void)new std::shared_ptr<std::byte[]>(std::move(impl_->storage));
}

void Reducer::prepare_for_backward() {
  std::lock_guard<std::mutex> g(impl_->mu);
  Impl& s = *impl_;
  if (s.no_sync_depth > 0) return;
  s.check_usable();
  if (s.open && s.ready_count > 0) throw Error(msg::prior_iteration(s.group.rank(), s.stats.iteration, s.params, s.unready()));
  s.begin_iteration();
}

void Reducer::mark_ready(size_t param, const void* grad) {
  std::lock_guard<std::mutex> g(impl_->mu);
  impl_->mark_ready(param, grad);
}

bool Reducer::finalize() {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->finalize();
}

void Reducer::set_grad(size_t param, void* grad) {
  std::lock_guard<std::mutex> g(impl_->mu);
  impl_->check_param(param, "set_grad");
  impl_->params[param].grad = grad;
}

namespace {
void refuse_when_recycled(const ReducerOptions& o, const char* call) {
  if (o.recycled_buckets > 0)
    throw InvalidArgument(fmt::format("Reducer::{}: with recycled_buckets a bucket has no lasting memory (it holds a "
                                      "pool buffer only while it is reduced); the comm hook sees its gradients",
                                      call));
}
}  // namespace

size_t Reducer::bucket_memory_bytes() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->pooled ? impl_->pool_count * impl_->pool_each : impl_->full_bytes;
}

void* Reducer::bucket_slot(size_t param) {
  impl_->check_param(param, "bucket_slot");
  refuse_when_recycled(impl_->opts, "bucket_slot");
  return impl_->slot(param);  // layout is fixed at construction: no lock needed
}

void* Reducer::bucket_data(size_t b) {
  refuse_when_recycled(impl_->opts, "bucket_data");
  if (b >= impl_->buckets.size())
    throw InvalidArgument(fmt::format("Reducer::bucket_data: bucket {} does not exist (the plan has {})", b,
                                      impl_->buckets.size()));
  return impl_->buckets[b].data;
}

void Reducer::register_comm_hook(CommHook hook) {
  std::lock_guard<std::mutex> g(impl_->mu);
  if (!hook) throw InvalidArgument("Reducer::register_comm_hook: the hook is empty");
  if (impl_->open || impl_->finalized > 0)
    throw InvalidArgument(fmt::format("rank {}: Reducer::register_comm_hook must be called before the first synced "
                                      "backward pass (every rank must use the same hook for every iteration)",
                                      impl_->group.rank()));
  impl_->hook = std::move(hook);
}

const BucketPlan& Reducer::plan() const { return impl_->plan; }
size_t Reducer::num_params() const { return impl_->params.size(); }

IterationStats Reducer::stats() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->stats;
}

void Reducer::enter_no_sync() {
  std::lock_guard<std::mutex> g(impl_->mu);
  Impl& s = *impl_;
  if (s.open && s.ready_count > 0)
    throw Error(msg::no_sync_mid_backward(s.group.rank(), s.stats.iteration, s.ready_count, s.params.size()));
  s.open = false;  // a prepare_for_backward() with no marks yet: that pass is now unsynced
  ++s.no_sync_depth;
}

bool Reducer::used_anywhere(size_t param) const {
  std::lock_guard<std::mutex> g(impl_->mu);
  impl_->check_param(param, "used_anywhere");
  return impl_->used_anywhere[param] != 0;
}

bool Reducer::in_no_sync() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->no_sync_depth > 0;
}

size_t Reducer::no_sync_marks() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->no_sync_marks;
}

void Reducer::leave_no_sync() {
  std::lock_guard<std::mutex> g(impl_->mu);
  --impl_->no_sync_depth;
}

NoSyncGuard::NoSyncGuard(Reducer& r) : reducer_(r) { reducer_.enter_no_sync(); }
NoSyncGuard::~NoSyncGuard() { reducer_.leave_no_sync(); }

}  // namespace cohort::ddp
