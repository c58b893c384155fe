// MpiGroup: the ProcessGroup of the MPI backend, and its factory.
//
// Every call checks its arguments (group/op.hpp validate), numbers the
// operation and runs it as one MPI call on the group's communicator:
//
//   allreduce       MPI_Allreduce / MPI_Iallreduce (in place: MPI_IN_PLACE)
//   broadcast       MPI_Bcast / MPI_Ibcast
//   reduce          MPI_Reduce / MPI_Ireduce
//   allgather       MPI_Allgather / MPI_Iallgather
//   reduce_scatter  MPI_Reduce_scatter_block / MPI_Ireduce_scatter_block
//   gather, scatter MPI_Gather, MPI_Scatter / MPI_Igather, MPI_Iscatter
//   alltoall        MPI_Alltoall / MPI_Ialltoall (nonblocking in place: from a copy)
//   barrier         MPI_Barrier
//   send, recv      MPI_Send, MPI_Recv / MPI_Isend, MPI_Irecv (tags are MPI tags)
//   batch           MPI_Isend / MPI_Irecv for each, then MPI_Waitall
//   new_group       MPI_Comm_split (non-members pass MPI_UNDEFINED)
//
// Where each call runs (docs/mpi.md):
//   - a collective of at most COHORT_MPI_BLOCKING_BYTES: MPI's blocking call on
//     the caller's thread (lowest latency), unless the progress thread is busy;
//   - a larger one, or any collective issued while the progress thread is busy:
//     MPI's blocking call on the progress thread (mpi_progress.hpp), in issue
//     order, returning a ThreadWork at once. With COHORT_MPI_ASYNC=nonblocking:
//     MPI's nonblocking call instead, completed by Work::wait (mpi_comm.hpp);
//   - point-to-point calls, new_group and shutdown: on the caller, after the
//     progress thread's queue is empty; large sends and receives nonblocking.
// Avg is MPI_SUM followed by a division by the group size on the ranks that
// get the result (core::scale_avg, as the native backend). f16 and bf16
// reduce through our own MPI_Op (mpi_runtime.hpp).
#include "group/mpi/mpi_group.hpp"

#include <fmt/format.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <set>

#include "core/env.hpp"
#include "core/log.hpp"
#include "core/reduce.hpp"
#include "group/mpi/mpi_comm.hpp"
#include "group/mpi/mpi_progress.hpp"

namespace cohort::group {

bool mpi_backend_built() {
  return true;
}

namespace mpi {
namespace {

using collectives::Coll;

const core::Knob kBlockingBytes{
    "COHORT_MPI_BLOCKING_BYTES", "64K",
    "mpi backend: calls whose message (count x element size, the count as in `cohort bench`) "
    "is at most this run as MPI's blocking call on the caller's thread (lowest latency); "
    "larger ones on the progress thread, or as nonblocking calls (COHORT_MPI_ASYNC)",
    core::KnobKind::Bytes};

const core::Knob kAsync{"COHORT_MPI_ASYNC", "thread",
                        "mpi backend: how calls above COHORT_MPI_BLOCKING_BYTES run: thread (MPI's blocking call on "
                        "the backend's progress thread, in issue order: Open MPI's fastest algorithms) or "
                        "nonblocking (MPI_Iallreduce, ... completed in Work::wait; no thread, but Open MPI's "
                        "libnbc is 25-30% slower for 1-16 MiB)"};

// True: the progress thread (COHORT_MPI_ASYNC=thread, and MPI allows calls from
// another thread). Throws InvalidArgument naming the knob on an unknown value.
bool use_progress_thread() {
  const std::string v = kAsync.str();
  if (v != "thread" && v != "nonblocking")
    throw InvalidArgument(
        fmt::format("COHORT_MPI_ASYNC={}: unknown mode; use thread or nonblocking (default thread)", v));
  if (v == "nonblocking") return false;
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  if (provided < MPI_THREAD_SERIALIZED) {
    COHORT_WARN(kInit,
                "mpi backend: MPI's thread level is {}, below serialized: large calls run as nonblocking MPI calls "
                "(COHORT_MPI_ASYNC=nonblocking), not on a progress thread",
                thread_level_name(provided));
    return false;
  }
  return true;
}

void* in_place_or(const void* p, bool in_place) {
  return in_place ? MPI_IN_PLACE : const_cast<void*>(p);
}

bool overlap(const Buffer& a, const Buffer& b) {
  auto* a0 = static_cast<const uint8_t*>(a.data);
  auto* b0 = static_cast<const uint8_t*>(b.data);
  return a0 < b0 + b.count * elem_size(b.dtype) && b0 < a0 + a.count * elem_size(a.dtype);
}

uint8_t* block(void* base, size_t i, size_t bytes) {
  return static_cast<uint8_t*>(base) + i * bytes;
}

// What runs after a call succeeded, on the ranks that got a result: the copy
// out of a scratch buffer, then Avg's division by the group size. A plain
// struct (no std::function) so that the blocking path stays allocation-free.
struct Finish {
  Buffer avg{};  // divide this by n (n == 0: no division)
  int n = 0;
  const void* copy_from = nullptr;  // copy this into copy_to first (nullptr: no copy)
  Buffer copy_to{};

  bool any() const { return n != 0 || copy_from != nullptr; }
  void operator()() const {
    if (copy_from != nullptr) std::memcpy(copy_to.data, copy_from, copy_to.bytes());
    if (n != 0) core::scale_avg(avg.data, avg.count, avg.dtype, n);
  }
};

class MpiGroup final : public ProcessGroup {
 public:
  MpiGroup(std::shared_ptr<CommState> c, bool thread)
      : c_(std::move(c)), blocking_max_(kBlockingBytes.bytes()), thread_(thread), n_(c_->size), me_(c_->rank) {
    Progress::get().attach();
  }
  ~MpiGroup() override { shutdown(); }

  int rank() const override { return me_; }
  int size() const override { return n_; }
  std::string backend_name() const override { return "mpi"; }
  const std::vector<int>& world_ranks() const override { return c_->world_ranks; }

  WorkPtr allreduce(Buffer send, Buffer recv, AllreduceOptions o) override {
    OpDesc d{Coll::Allreduce, send, recv, o.op, 0, -1, 0, o.timeout};
    const int count = mpi_count(d, send.count);
    const MPI_Datatype t = datatype(send.dtype);
    const MPI_Op op = op_for(o.op, send.dtype);
    void* sbuf = in_place_or(send.data, send.data == recv.data);
    // The checks of validate() inline, on the latency-critical call; validate
    // itself runs (and throws its message) only when one fails.
    const bool ok = static_cast<uint8_t>(send.dtype) < kNumDTypes && send.dtype == recv.dtype &&
                    send.count == recv.count && static_cast<uint8_t>(o.op) < kNumReduceOps &&
                    (send.count == 0 || (send.data != nullptr && recv.data != nullptr)) &&
                    (send.data == recv.data || !overlap(send, recv));
    if (!ok) validate(d, me_, n_);
    const Finish finish = avg_finish(o.op, recv);
    return issue<true>(
        d, send.count * elem_size(send.dtype), "MPI_Allreduce",
        [=, this] { return MPI_Allreduce(sbuf, recv.data, count, t, op, c_->comm); },
        [&](MPI_Request* r) { return MPI_Iallreduce(sbuf, recv.data, count, t, op, c_->comm, r); }, finish);
  }

  WorkPtr broadcast(Buffer buf, BroadcastOptions o) override {
    OpDesc d{Coll::Broadcast, buf, buf, ReduceOp::Sum, o.root, -1, 0, o.timeout};
    const int count = mpi_count(d, buf.count);
    const MPI_Datatype t = datatype(buf.dtype);
    return issue(
        d, buf.count * elem_size(buf.dtype), "MPI_Bcast",
        [=, this] { return MPI_Bcast(buf.data, count, t, o.root, c_->comm); },
        [&](MPI_Request* r) { return MPI_Ibcast(buf.data, count, t, o.root, c_->comm, r); }, Finish{});
  }

  WorkPtr reduce(Buffer send, Buffer recv, ReduceOptions o) override {
    OpDesc d{Coll::Reduce, send, recv, o.op, o.root, -1, 0, o.timeout};
    const bool root = me_ == o.root;
    const int count = mpi_count(d, send.count);
    const MPI_Datatype t = datatype(send.dtype);
    const MPI_Op op = op_for(o.op, send.dtype);
    void* sbuf = in_place_or(send.data, root && send.data == recv.data);
    void* rbuf = root ? recv.data : nullptr;
    const Finish finish = root ? avg_finish(o.op, recv) : Finish{};
    return issue(
        d, send.count * elem_size(send.dtype), "MPI_Reduce",
        [=, this] { return MPI_Reduce(sbuf, rbuf, count, t, op, o.root, c_->comm); },
        [&](MPI_Request* r) { return MPI_Ireduce(sbuf, rbuf, count, t, op, o.root, c_->comm, r); }, finish);
  }

  WorkPtr allgather(Buffer send, Buffer recv, AllgatherOptions o) override {
    OpDesc d{Coll::Allgather, send, recv, ReduceOp::Sum, 0, -1, 0, o.timeout};
    const int count = mpi_count(d, send.count);
    mpi_count(d, recv.count);
    const MPI_Datatype t = datatype(send.dtype);
    void* sbuf = in_place_or(send.data, send.data == block(recv.data, me_, send.bytes()) && send.count > 0);
    return issue(
        d, send.count * elem_size(send.dtype), "MPI_Allgather",
        [=, this] { return MPI_Allgather(sbuf, count, t, recv.data, count, t, c_->comm); },
        [&](MPI_Request* r) { return MPI_Iallgather(sbuf, count, t, recv.data, count, t, c_->comm, r); }, Finish{});
  }

  WorkPtr reduce_scatter(Buffer send, Buffer recv, ReduceScatterOptions o) override {
    OpDesc d{Coll::ReduceScatter, send, recv, o.op, 0, -1, 0, o.timeout};
    const int count = mpi_count(d, recv.count);
    mpi_count(d, send.count);
    const MPI_Datatype t = datatype(send.dtype);
    const MPI_Op op = op_for(o.op, send.dtype);
    // In place (one buffer): MPI reads all blocks from recvbuf and leaves the result in its first block.
    const bool same = send.data == recv.data && send.count > 0;
    void* sbuf = in_place_or(send.data, same);
    void* rbuf = recv.data;
    Finish finish = avg_finish(o.op, recv);
    std::vector<uint8_t> tmp;
    if (!same && recv.count > 0 && overlap(send, recv)) {
      // recv inside send (PyTorch's in-place convention: recv = block `rank`
      // of send): MPI may not write where it reads, so the result goes to a
      // scratch buffer first.
      tmp.resize(recv.bytes());
      rbuf = tmp.data();
      finish.copy_from = rbuf;
      finish.copy_to = recv;
    }
    return issue(
        d, recv.count * elem_size(recv.dtype), "MPI_Reduce_scatter_block",
        [=, this] { return MPI_Reduce_scatter_block(sbuf, rbuf, count, t, op, c_->comm); },
        [&](MPI_Request* r) { return MPI_Ireduce_scatter_block(sbuf, rbuf, count, t, op, c_->comm, r); }, finish, &tmp);
  }

  WorkPtr gather(Buffer send, Buffer recv, GatherOptions o) override {
    OpDesc d{Coll::Gather, send, recv, ReduceOp::Sum, o.root, -1, 0, o.timeout};
    const bool root = me_ == o.root;
    if (!root) d.recv = Buffer{nullptr, 0, send.dtype};  // ignored away from the root
    const int count = mpi_count(d, send.count);
    if (root) mpi_count(d, recv.count);
    const MPI_Datatype t = datatype(send.dtype);
    void* sbuf = in_place_or(send.data, root && send.count > 0 && send.data == block(recv.data, me_, send.bytes()));
    void* rbuf = root ? recv.data : nullptr;
    return issue(
        d, send.count * elem_size(send.dtype), "MPI_Gather",
        [=, this] { return MPI_Gather(sbuf, count, t, rbuf, count, t, o.root, c_->comm); },
        [&](MPI_Request* r) { return MPI_Igather(sbuf, count, t, rbuf, count, t, o.root, c_->comm, r); }, Finish{});
  }

  WorkPtr scatter(Buffer send, Buffer recv, ScatterOptions o) override {
    OpDesc d{Coll::Scatter, send, recv, ReduceOp::Sum, o.root, -1, 0, o.timeout};
    const bool root = me_ == o.root;
    if (!root) d.send = Buffer{nullptr, 0, recv.dtype};  // ignored away from the root
    const int count = mpi_count(d, recv.count);
    if (root) mpi_count(d, send.count);
    const MPI_Datatype t = datatype(recv.dtype);
    void* sbuf = root ? send.data : nullptr;
    void* rbuf = in_place_or(recv.data, root && recv.count > 0 && recv.data == block(send.data, me_, recv.bytes()));
    return issue(
        d, recv.count * elem_size(recv.dtype), "MPI_Scatter",
        [=, this] { return MPI_Scatter(sbuf, count, t, rbuf, count, t, o.root, c_->comm); },
        [&](MPI_Request* r) { return MPI_Iscatter(sbuf, count, t, rbuf, count, t, o.root, c_->comm, r); }, Finish{});
  }

  WorkPtr alltoall(Buffer send, Buffer recv, AlltoallOptions o) override {
    OpDesc d{Coll::Alltoall, send, recv, ReduceOp::Sum, 0, -1, 0, o.timeout};
    validate(d, me_, n_);
    const int k = mpi_count(d, send.count / static_cast<size_t>(n_));
    mpi_count(d, send.count);
    const MPI_Datatype t = datatype(send.dtype);
    const bool in_place = send.data == recv.data && send.count > 0;
    std::vector<uint8_t> copy;
    return issue<true>(
        d, send.count * elem_size(send.dtype), "MPI_Alltoall",
        [=, this] { return MPI_Alltoall(in_place_or(send.data, in_place), k, t, recv.data, k, t, c_->comm); },
        [&](MPI_Request* r) {
          const void* src = send.data;
          if (in_place) {  // the nonblocking call reads from a copy, which the Work keeps until it completes
            copy.assign(static_cast<const uint8_t*>(send.data), static_cast<const uint8_t*>(send.data) + send.bytes());
            src = copy.data();
          }
          return MPI_Ialltoall(src, k, t, recv.data, k, t, c_->comm, r);
        },
        Finish{}, &copy);
  }

  WorkPtr barrier(BarrierOptions o) override {
    OpDesc d{Coll::Barrier, {}, {}, ReduceOp::Sum, 0, -1, 0, o.timeout};
    return issue(
        d, 0, "MPI_Barrier", [=, this] { return MPI_Barrier(c_->comm); },
        [&](MPI_Request* r) { return MPI_Ibarrier(c_->comm, r); }, Finish{});
  }

  WorkPtr send(Buffer buf, int dst, SendRecvOptions o) override {
    OpDesc d{Coll::Send, buf, {}, ReduceOp::Sum, 0, dst, o.tag, o.timeout};
    validate(d, me_, n_);
    check_tag(d, o.tag);
    const int count = mpi_count(d, buf.count);
    const MPI_Datatype t = datatype(buf.dtype);
    return issue<true, false>(
        d, buf.count * elem_size(buf.dtype), "MPI_Send",
        [&] { return MPI_Send(buf.data, count, t, dst, o.tag, c_->comm); },
        [&](MPI_Request* r) { return MPI_Isend(buf.data, count, t, dst, o.tag, c_->comm, r); }, Finish{});
  }

  WorkPtr recv(Buffer buf, int src, SendRecvOptions o) override {
    OpDesc d{Coll::Recv, {}, buf, ReduceOp::Sum, 0, src, o.tag, o.timeout};
    validate(d, me_, n_);
    check_tag(d, o.tag);
    const int count = mpi_count(d, buf.count);
    const MPI_Datatype t = datatype(buf.dtype);
    MPI_Status st;
    auto w = issue<true, false>(
        d, buf.count * elem_size(buf.dtype), "MPI_Recv",
        [&] { return MPI_Recv(buf.data, count, t, src, o.tag, c_->comm, &st); },
        [&](MPI_Request* r) { return MPI_Irecv(buf.data, count, t, src, o.tag, c_->comm, r); }, Finish{}, nullptr,
        static_cast<int64_t>(buf.bytes()), &st);
    return w;
  }

  WorkPtr batch_isend_irecv(const std::vector<P2POp>& ops, Millis timeout) override {
    OpDesc d{Coll::P2PBatch};
    d.timeout = timeout;
    d.batch = ops;
    validate(d, me_, n_);
    for (const auto& op : ops) {
      check_tag(d, op.tag);
      mpi_count(d, op.buf.count);
    }
    Progress::get().wait_idle();
    std::lock_guard<MpiLock> g(mpi_lock());
    check_open(d);
    d.seq = ++c_->seq;
    const Millis t = d.timeout.count() > 0 ? d.timeout : c_->timeout;
    auto w = std::make_shared<MpiWork>(c_, d, t);
    w->reqs.resize(ops.size(), MPI_REQUEST_NULL);
    w->recv_counts.assign(ops.size(), -1);
    for (size_t i = 0; i < ops.size(); ++i) {
      const P2POp& op = ops[i];
      const int count = static_cast<int>(op.buf.count);
      int rc;
      if (op.kind == P2POp::Send) {
        rc = MPI_Isend(op.buf.data, count, datatype(op.buf.dtype), op.peer, op.tag, c_->comm, &w->reqs[i]);
      } else {
        rc = MPI_Irecv(op.buf.data, count, datatype(op.buf.dtype), op.peer, op.tag, c_->comm, &w->reqs[i]);
        w->recv_counts[i] = static_cast<int64_t>(op.buf.bytes());
      }
      if (rc != MPI_SUCCESS) {
        // The requests started so far stay in the Work, which completes them (MPI cannot take them back).
        w->reqs.resize(i);
        w->recv_counts.resize(i);
        c_->pending.push_back(w);
        throw_mpi_error(rc, op.kind == P2POp::Send ? "MPI_Isend" : "MPI_Irecv", d, me_);
      }
    }
    c_->pending.push_back(w);
    if (d.bytes() <= blocking_max_) c_->complete_through(w.get(), nullptr);  // small: done before returning
    return w;
  }

  std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks) override {
    std::set<int> seen;
    if (ranks.empty()) throw InvalidArgument("new_group: the list of ranks is empty");
    for (int r : ranks) {
      if (r < 0 || r >= n_)
        throw InvalidArgument(fmt::format("new_group: rank {} is out of range; this group has ranks 0..{}", r, n_ - 1));
      if (!seen.insert(r).second) throw InvalidArgument(fmt::format("new_group: rank {} is listed twice", r));
    }
    auto it = std::find(ranks.begin(), ranks.end(), me_);
    const bool member = it != ranks.end();
    MPI_Comm sub = MPI_COMM_NULL;
    OpDesc d{Coll::Barrier};
    Progress::get().wait_idle();
    std::lock_guard<MpiLock> g(mpi_lock());
    check_open(d);
    c_->drain(true);
    int rc;
    {
      Armed a(d, me_, c_->timeout, "MPI_Comm_split");
      // Every rank of this group takes part; the key orders the new group as `ranks` does.
      rc =
          MPI_Comm_split(c_->comm, member ? 0 : MPI_UNDEFINED, member ? static_cast<int>(it - ranks.begin()) : 0, &sub);
    }
    if (rc != MPI_SUCCESS) throw_mpi_error(rc, "MPI_Comm_split", d, me_);
    if (!member) return nullptr;
    std::vector<int> world;
    for (int r : ranks) world.push_back(c_->world_ranks[r]);
    return std::make_shared<MpiGroup>(std::make_shared<CommState>(sub, c_->timeout, std::move(world)), thread_);
  }

  // Completes the queued and pending Works (MPI cannot cancel them), then
  // frees the communicator; the last group's shutdown joins the progress thread.
  void shutdown() override {
    if (detached_) return;
    detached_ = true;
    Progress& p = Progress::get();
    p.wait_idle();
    {
      std::lock_guard<MpiLock> g(mpi_lock());
      c_->shutdown();
    }
    p.detach();
  }

 private:
  // Runs one operation: validates it, then the blocking call (small) or the
  // nonblocking one, returning its Work. `scratch` moves into the Work;
  // recv_bytes >= 0 checks what a receive got (status: the blocking call's).
  // `queueable`: a collective, which may run on the progress thread (its
  // `blocking` must then capture by value); false: point-to-point, which runs
  // here after the queue is empty.
  template <bool prevalidated = false, bool queueable = true, class Blocking, class Nonblocking>
  WorkPtr issue(OpDesc& d, size_t call_bytes, const char* call, Blocking&& blocking, Nonblocking&& nonblocking,
                const Finish& finish, std::vector<uint8_t>* scratch = nullptr, int64_t recv_bytes = -1,
                MPI_Status* status = nullptr) {
    if (!prevalidated) validate(d, me_, n_);
    const Millis t = d.timeout.count() > 0 ? d.timeout : c_->timeout;
    if (thread_) {
      Progress& p = Progress::get();
      if constexpr (queueable) {
        // Behind what is queued even when small: every rank's MPI calls stay in issue order.
        if (call_bytes > blocking_max_ || p.busy()) return queue(d, t, call, blocking, finish, scratch);
      } else {
        p.wait_idle();
      }
    }
    std::lock_guard<MpiLock> g(mpi_lock());
    check_open(d);
    d.seq = ++c_->seq;
    // The path must be the same on every rank (MPI's blocking and nonblocking
    // collectives do not match each other), so it goes by call_bytes: the
    // call's count x element size, which every rank has in common, not the
    // bytes this rank moves.
    if (call_bytes <= blocking_max_) {
      // In order: the collectives issued before complete first (point-to-point calls complete on their own).
      if (!c_->pending.empty() && !is_p2p(d)) c_->drain(true);
      int rc;
      {
        Armed a(d, me_, t, call);
        rc = blocking();
      }
      check(rc, call, d, me_);
      if (status != nullptr && recv_bytes >= 0) check_received(d, *status, recv_bytes);
      finish();
      return c_->done(d);
    }
    auto w = std::make_shared<MpiWork>(c_, d, t);
    w->reqs.assign(1, MPI_REQUEST_NULL);
    w->recv_counts.assign(1, recv_bytes);
    if (int rc = nonblocking(&w->reqs[0]); rc != MPI_SUCCESS)
      throw_mpi_error(rc, nonblocking_name(call).c_str(), d, me_);
    if (finish.any()) w->finish = [finish] { finish(); };
    if (scratch != nullptr) w->scratch = std::move(*scratch);
    c_->pending.push_back(w);
    return w;
  }

  // Queues the blocking call on the progress thread and returns its Work,
  // which completes (with the call's error, if any) when the call returned and
  // `finish` ran. The task owns `scratch` until then.
  template <class Blocking>
  WorkPtr queue(OpDesc& d, Millis t, const char* call, const Blocking& blocking, const Finish& finish,
                std::vector<uint8_t>* scratch) {
    check_open(d);
    d.seq = ++c_->seq;
    auto w = std::make_shared<ThreadWork>(d, me_, t);
    std::vector<uint8_t> keep;
    if (scratch != nullptr) keep = std::move(*scratch);
    Progress::get().submit([w, blocking, finish, keep = std::move(keep), call, me = me_]() {
      std::exception_ptr err;
      try {
        std::lock_guard<MpiLock> g(mpi_lock());
        int rc;
        {
          Armed a(w->desc(), me, w->timeout(), call);
          rc = blocking();
        }
        check(rc, call, w->desc(), me);
        finish();
      } catch (...) {
        err = std::current_exception();
      }
      w->complete(err);
    });
    return w;
  }

  static bool is_p2p(const OpDesc& d) { return d.coll == Coll::Send || d.coll == Coll::Recv; }

  static std::string nonblocking_name(const char* call) {  // "MPI_Allreduce" -> "MPI_Iallreduce"
    return fmt::format("MPI_I{}{}", static_cast<char>(std::tolower(call[4])), call + 5);
  }

  Finish avg_finish(ReduceOp op, Buffer recv) const {
    if (op != ReduceOp::Avg) return {};
    return Finish{recv, n_};
  }

  void check_received(const OpDesc& d, MPI_Status& st, int64_t want) const {
    int got = 0;
    MPI_Get_count(&st, MPI_BYTE, &got);
    if (got != want)
      throw InvalidArgument(
          fmt::format("rank {}: {}: received {} bytes from rank {} where {} were expected; the "
                      "receiver's count must equal the sender's",
                      me_, d.describe(), got, st.MPI_SOURCE, want));
  }

  // MPI counts are ints.
  int mpi_count(const OpDesc& d, size_t count) const {
    if (count > static_cast<size_t>(INT_MAX))
      throw InvalidArgument(
          fmt::format("rank {}: {}: {} elements is more than MPI's int count allows ({}); split the "
                      "buffer into smaller calls or use COHORT_BACKEND=native",
                      me_, collectives::coll_name(d.coll), count, INT_MAX));
    return static_cast<int>(count);
  }

  void check_tag(const OpDesc& d, int tag) const {
    const int tag_ub = g_tag_ub;
    if (tag > tag_ub)
      throw InvalidArgument(fmt::format("rank {}: {}: tag {} is above this MPI's largest tag (MPI_TAG_UB = {})", me_,
                                        collectives::coll_name(d.coll), tag, tag_ub));
  }

  void check_open(const OpDesc& d) const {
    if (c_->shut_down)
      throw InvalidArgument(
          fmt::format("rank {}: {}: the group was shut down; create a new one with "
                      "init_process_group",
                      me_, collectives::coll_name(d.coll)));
  }

  std::shared_ptr<CommState> c_;
  size_t blocking_max_;
  bool thread_;  // large collectives on the progress thread (else nonblocking MPI calls)
  bool detached_ = false;
  int n_, me_;
};

}  // namespace
}  // namespace mpi

std::shared_ptr<ProcessGroup> create_mpi_group(std::optional<int> rank, std::optional<int> world_size, Millis timeout) {
  mpi::ensure_initialized();
  std::lock_guard<mpi::MpiLock> g(mpi::mpi_lock());
  int me = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  core::set_log_rank(me);
  if (rank && *rank != me)
    throw InvalidArgument(
        fmt::format("backend 'mpi': the rank given ({}) is not MPI's ({}); with the mpi backend MPI "
                    "decides ranks: leave InitOptions::rank unset",
                    *rank, me));
  // Started by `cohort run` or torchrun instead of mpirun: every process would be an MPI world of its own.
  const char* ws = std::getenv("WORLD_SIZE");
  if (!world_size && ws != nullptr && *ws != '\0' && std::atoi(ws) != n)
    throw InvalidArgument(
        fmt::format("backend 'mpi': WORLD_SIZE is {} but MPI's world has {} process(es): the mpi "
                    "backend needs its processes started by mpirun (or srun with PMI), not by "
                    "`cohort run` or torchrun; HINT: COHORT_BACKEND=mpi mpirun -np {} ./program, or "
                    "use COHORT_BACKEND=native under cohort run",
                    ws, n, ws));
  if (world_size && *world_size != n)
    throw InvalidArgument(
        fmt::format("backend 'mpi': the world size given ({}) is not MPI's ({}); start as many "
                    "processes with mpirun -np, or leave InitOptions::world_size unset",
                    *world_size, n));
  MPI_Comm comm = MPI_COMM_NULL;
  int rc = MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  if (rc != MPI_SUCCESS) {
    OpDesc d{collectives::Coll::Barrier};
    mpi::throw_mpi_error(rc, "MPI_Comm_dup", d, me);
  }
  std::vector<int> world(n);
  for (int r = 0; r < n; ++r) world[r] = r;
  char version[MPI_MAX_LIBRARY_VERSION_STRING] = {0};
  int len = 0;
  MPI_Get_library_version(version, &len);
  std::string lib(version, strnlen(version, sizeof(version)));
  if (auto nl = lib.find_first_of(",\n"); nl != std::string::npos) lib.resize(nl);
  const bool thread = mpi::use_progress_thread();
  COHORT_INFO(kInit, "rank {} of {}: mpi backend on {}; blocking calls up to {} bytes on the caller, larger ones {}",
              me, n, lib, mpi::kBlockingBytes.bytes(),
              thread ? "blocking on the progress thread" : "as nonblocking MPI calls");
  return std::make_shared<mpi::MpiGroup>(std::make_shared<mpi::CommState>(comm, timeout, std::move(world)), thread);
}

}  // namespace cohort::group
