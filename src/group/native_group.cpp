// NativeGroup: queue, progress thread, execution and failure handling.
#include "group/native_group.hpp"

#include <fmt/format.h>

#include <cstring>

#include "collectives/algorithms.hpp"
#include "core/env.hpp"
#include "core/input_pieces.hpp"
#include "core/log.hpp"
#include "core/reduce.hpp"
#include "core/timeline.hpp"
#include "group/op_timeline.hpp"

namespace cohort::group {
namespace {

const core::Knob kInlineBytes{"COHORT_INLINE_BYTES", "64K",
                              "operations of at most this many bytes run on the caller's thread when nothing is queued "
                              "(no thread hand-off); 0 sends everything to the progress thread",
                              core::KnobKind::Bytes};
const core::Knob kPipelineSeg{"COHORT_PIPELINE_BYTES", "256K", "segment size of pipelined algorithms (broadcast chain)",
                              core::KnobKind::Bytes};

using collectives::Algo;
using collectives::Coll;

bool is_p2p(Coll c) { return c == Coll::Send || c == Coll::Recv || c == Coll::P2PBatch; }

std::string describe_key(const transport::MsgKey& k) {
  if (k.kind == 1) return fmt::format("point-to-point message #{} (tag {})", k.seq, k.tag);
  return describe_call(k.seq, k.tag, k.count);
}

// Both calls, by name: the heart of desync diagnosis.
std::string mismatch_message(const transport::MessageMismatch& m) {
  if (m.got == m.want && m.want.kind == 1)  // point-to-point keys carry no count: the sizes are the users'
    return fmt::format("rank {} sent {} bytes for {} where this rank receives {} bytes; HINT: the send and the matching "
                       "recv must have the same count and dtype",
                       m.peer(), m.got_bytes, describe_key(m.want), m.want_bytes);
  if (m.got == m.want)
    return fmt::format("rank {} sent {} bytes for {} where this rank expected {} bytes; HINT: this is a cohort bug or "
                       "memory corruption",
                       m.peer(), m.got_bytes, describe_key(m.want), m.want_bytes);
  return fmt::format("desync: rank {} is in {} while this rank is in {}; HINT: every rank must issue the same "
                     "collectives in the same order with the same count, dtype, op and root (a rank that skipped or added "
                     "a call, or a count that depends on the rank?)",
                     m.peer(), describe_key(m.got), describe_key(m.want));
}

}  // namespace

NativeGroup::NativeGroup(GroupSetup setup)
    : setup_(std::move(setup)),
      inline_max_(kInlineBytes.bytes()),
      pipeline_segment_(std::max<size_t>(4096, kPipelineSeg.bytes())),
      thresholds_(collectives::thresholds_from_env()) {
  p2p_sent_.assign(setup_.size, 0);
  p2p_recvd_.assign(setup_.size, 0);
}

std::shared_ptr<NativeGroup> NativeGroup::create(GroupSetup setup) {
  std::shared_ptr<NativeGroup> g(new NativeGroup(std::move(setup)));
  g->connect();
  if (g->heartbeat_ms_ > 0) {  // the progress thread doubles as the heartbeat (flight_recorder.hpp)
    g->publish_heartbeat();
    g->thread_ = std::thread([p = g.get()] { p->progress_loop(); });
  }
  return g;
}

NativeGroup::~NativeGroup() { shutdown(); }

void NativeGroup::shutdown() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  core::timeline::flush();
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& [d, w] : queue_)
    w->complete(std::make_exception_ptr(Error(fmt::format("{} was cancelled: the group was shut down", d.describe()))));
  queue_.clear();
}

WorkPtr NativeGroup::submit(OpDesc d) {
  validate(d, setup_.rank, setup_.size);
  std::unique_lock<std::mutex> lk(mu_);
  if (stopping_) throw Error(fmt::format("{}: the process group was shut down", collectives::coll_name(d.coll)));
  // Collectives are numbered alike on every rank (message keys, the flight
  // recorder, hang verdicts); point-to-point calls are not (the two ends, and
  // ranks that take no part, issue different numbers of them), so they have
  // their own count and stay out of the recorder.
  const bool p2p = is_p2p(d.coll);
  d.seq = p2p ? next_p2p_seq_++ : next_seq_++;
  const bool run_inline = queue_.empty() && !busy_ && d.bytes() <= inline_max_;
  if (!p2p) recorder_.called(d.seq, d.fingerprint(), d.call_count(), run_inline);
  if (run_inline) {
    auto w = std::make_shared<WorkImpl>(d, d.timeout.count() > 0 ? d.timeout : setup_.timeout);
    run_locked(lk, d, *w);
    return w;
  }
  if (core::timeline::enabled()) d.queued_ns = core::timeline::now_ns();
  auto w = std::make_shared<WorkImpl>(d, d.timeout.count() > 0 ? d.timeout : setup_.timeout, std::weak_ptr<WorkRunner>(weak_from_this()));
  queue_.emplace_back(std::move(d), w);
  if (!thread_.joinable()) thread_ = std::thread([this] { progress_loop(); });
  lk.unlock();
  cv_.notify_one();
  return w;
}

void NativeGroup::run_locked(std::unique_lock<std::mutex>& lk, OpDesc& d, WorkImpl& w) {
  busy_ = true;
  lk.unlock();
  std::exception_ptr err;
  const bool recorded = !is_p2p(d.coll);
  if (recorded) recorder_.started(d.seq);
  const int64_t t0 = core::timeline::enabled() ? core::timeline::now_ns() : 0;
  try {
    execute(d);
  } catch (...) {
    err = std::current_exception();
  }
  if (recorded) recorder_.finished(d.seq, !err);
  if (t0 != 0) record_op(setup_.group_id, setup_.rank, d, t0, core::timeline::now_ns(), err != nullptr);
  w.complete(err);
  lk.lock();
  busy_ = false;
}

bool NativeGroup::run_if_next(WorkImpl* w) {
  std::unique_lock<std::mutex> lk(mu_);
  if (busy_ || stopping_ || queue_.empty() || queue_.front().second.get() != w) return false;
  auto [d, work] = std::move(queue_.front());
  queue_.pop_front();
  run_locked(lk, d, *work);
  lk.unlock();
  cv_.notify_all();  // the progress thread waits for !busy_ before it takes the next one
  return true;
}

void NativeGroup::progress_loop() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    // Inline operations run only while the queue is empty and we are idle, so
    // waiting for !busy_ keeps the issue order.
    auto ready = [&] { return stopping_ || (!queue_.empty() && !busy_); };
    if (heartbeat_ms_ <= 0) cv_.wait(lk, ready);
    else if (!cv_.wait_for(lk, Millis(heartbeat_ms_), ready)) {
      lk.unlock();
      publish_heartbeat();
      lk.lock();
      continue;
    }
    if (stopping_) return;
    auto [d, w] = std::move(queue_.front());
    queue_.pop_front();
    run_locked(lk, d, *w);
    // Busy with queued work back to back, the wait above never times out:
    // publish here too, once a heartbeat period has passed (native_group_diag.cpp).
    if (heartbeat_ms_ > 0 && FlightRecorder::now_ns() - last_heartbeat_ns_ >= heartbeat_ms_ * 1'000'000) {
      lk.unlock();
      publish_heartbeat();
      lk.lock();
    }
  }
}

void NativeGroup::execute(OpDesc& d) {
  if (broken_) {
    try {
      std::rethrow_exception(broken_);
    } catch (const Error& e) {
      throw Error(fmt::format("rank {}: {} not started: this group failed earlier: {}", setup_.rank, d.describe(), e.what()));
    }
  }
  try {
    run_algorithm(d);
  } catch (...) {
    fail(d, std::current_exception());
  }
}

collectives::TunerInput NativeGroup::tuner_input(collectives::Coll c, size_t tuner_bytes) const {
  return collectives::TunerInput{c,           tuner_bytes,   setup_.size, all_shm_, single_copy_, layout_.hosts,
                                 hier_why_.empty() ? layout_.ranks_per_host : 0};
}

std::pair<collectives::Algo, bool> NativeGroup::algorithm_for(const collectives::TunerInput& in) const {
  const std::optional<Algo> forced = collectives::forced_algo(in.coll);
  // COHORT_ALGO is one setting for every group of the process, and
  // sub-groups often lie on one host: they run the flat choice instead.
  if (!forced || (*forced == Algo::Hierarchical && !hier_why_.empty()))
    return {collectives::choose(in, thresholds_), false};
  return {*forced, true};
}

// The tuner's choice for d, or COHORT_ALGO's; refuses a forced single copy
// the group cannot run.
std::pair<collectives::Algo, bool> NativeGroup::pick_algorithm(const OpDesc& d) {
  namespace c = collectives;
  const int n = setup_.size;
  size_t tuner_bytes = d.coll == Coll::Allgather || d.coll == Coll::Gather || d.coll == Coll::Alltoall
                           ? d.send.bytes() / (d.coll == Coll::Alltoall ? n : 1)
                           : d.bytes();
  const auto [a, honoured] = algorithm_for(tuner_input(d.coll, tuner_bytes));
  if (c::forced_algo(d.coll) == Algo::Hierarchical && !hier_why_.empty()) {
    if (!hier_warned_ && n > 1)
      COHORT_WARN(kTuning, "group {}: COHORT_ALGO asks for hierarchical, but {} (it needs 2 or more hosts with as "
                  "many ranks, at least 2, on each): this group runs the flat algorithms", setup_.group_id, hier_why_);
    hier_warned_ = true;
  }
  if (a == Algo::SingleCopy && !single_copy_ && n > 1)
    throw InvalidArgument(fmt::format("COHORT_ALGO asks for single_copy, but this group cannot use it: {}; HINT: unset "
                                      "COHORT_ALGO or name another algorithm for {}",
                                      single_copy_why_, c::coll_name(d.coll)));
  return {a, honoured};
}

void NativeGroup::begin_views(const collectives::Comm& comm, core::Deadline deadline) {
  local_comm_->begin(comm.key(), deadline);
  cross_comm_->begin(comm.key(), deadline);
}

// The node-aware algorithms' phases on each host may run by single copy (they
// check that every local rank's buffers are shared buffers): the host's shm
// links allow it, and the buffer is at least as large as where one-host
// collectives take single copy on shared buffers.
bool NativeGroup::host_single_copy(size_t total_bytes) const {
  return local_single_copy_ && thresholds_.allreduce_single_copy_shared_min > 0 &&
         total_bytes >= thresholds_.allreduce_single_copy_shared_min;
}

// The allreduce case of run_algorithm (algorithm a, as picked there).
void NativeGroup::run_allreduce(OpDesc& d, collectives::Algo a, bool shared_only, core::Deadline deadline) {
  namespace c = collectives;
  auto& comm = *comm_;
  auto* sp = static_cast<const uint8_t*>(d.send.data);
  auto* rp = static_cast<uint8_t*>(d.recv.data);
  const DType t = d.send.dtype;
  const ReduceOp op = d.op == ReduceOp::Avg ? ReduceOp::Sum : d.op;
  const int n = setup_.size, avg_div = d.op == ReduceOp::Avg ? n : 0;
  // allreduce_gathered: single copy places the pieces itself (reading its own block's in place)
  if (a != Algo::SingleCopy) core::copy_pieces(d.recv, d.pieces);
  if (a == Algo::Ring) {
    c::allreduce_ring(comm, sp, rp, d.send.count, t, op, avg_div);
  } else if (a == Algo::Hierarchical && n > 1) {
    begin_views(comm, deadline);
    // On each host by single copy when every local rank's buffers are shared buffers, else the ring's halves.
    if (c::allreduce_hierarchical(*local_comm_, *cross_comm_, sp, rp, d.send.count, t, op, avg_div,
                                  thresholds_.allreduce_rd_max_tcp, host_single_copy(d.send.bytes())))
      COHORT_TRACE(kColl, "{}: shared buffers on this host: its phases by single copy", d.describe());
  } else if (a == Algo::SingleCopy) {
    if (!c::allreduce_single_copy(comm, sp, rp, d.send.count, t, op, avg_div, shared_only, d.pieces)) {
      d.algo = c::algo_name(Algo::Ring);
      COHORT_TRACE(kColl, "{}: not every rank's buffers are shared: ring", d.describe());
      c::allreduce_ring(comm, sp, rp, d.send.count, t, op, avg_div);
    }
  } else {
    c::allreduce_recursive_doubling(comm, sp, rp, d.send.count, t, op);
    if (d.op == ReduceOp::Avg) core::scale_avg(rp, d.recv.count, t, n);
  }
}

void NativeGroup::run_algorithm(OpDesc& d) {
  namespace c = collectives;
  auto timeout = d.timeout.count() > 0 ? d.timeout : setup_.timeout;
  auto deadline = core::Deadline::after(timeout);
  auto& comm = *comm_;
  auto* sp = static_cast<const uint8_t*>(d.send.data);
  auto* rp = static_cast<uint8_t*>(d.recv.data);
  const DType t = d.coll == Coll::Recv || d.coll == Coll::Broadcast ? d.recv.dtype : d.send.dtype;
  const ReduceOp op = d.op == ReduceOp::Avg ? ReduceOp::Sum : d.op;
  const int n = setup_.size;

  if (is_p2p(d.coll)) {
    run_p2p(d, deadline);
    return;
  }

  comm.begin(transport::MsgKey{d.seq, d.fingerprint(), 0, d.call_count()}, deadline);
  const auto [a, forced] = pick_algorithm(d);
  d.algo = c::algo_name(a);
  // In place, or one buffer inside the other: the algorithms below read their
  // input while they write their output, so they get a copy of the input
  // (allreduce handles in place itself; partial overlap is refused there).
  // The in-place layouts the algorithms handle themselves need no copy:
  // reduce with send == recv, reduce_scatter with recv = send's block of this
  // rank, allgather / gather with send = recv's block of this rank.
  std::vector<uint8_t> input_copy;
  const size_t me = static_cast<size_t>(setup_.rank);
  const bool supported_in_place = (d.coll == Coll::Reduce && sp == rp) ||
                                  (d.coll == Coll::ReduceScatter && rp == sp + me * d.recv.bytes()) ||
                                  ((d.coll == Coll::Allgather || d.coll == Coll::Gather) && sp == rp + me * d.send.bytes());
  const bool copy_input = d.coll == Coll::ReduceScatter || d.coll == Coll::Allgather || d.coll == Coll::Gather ||
                          d.coll == Coll::Alltoall || d.coll == Coll::Reduce || d.coll == Coll::Scatter;
  if (copy_input && !supported_in_place && sp != nullptr && rp != nullptr && d.send.bytes() > 0 &&
      d.recv.bytes() > 0 && sp < rp + d.recv.bytes() && rp < sp + d.send.bytes()) {
    if (d.coll == Coll::Alltoall) {  // alltoall_direct does not use the scratch buffer
      uint8_t* copy = comm.scratch(d.send.bytes());
      std::memcpy(copy, sp, d.send.bytes());
      sp = copy;
    } else {
      input_copy.assign(sp, sp + d.send.bytes());
      sp = input_copy.data();
    }
  }
  // Below allreduce_single_copy_min (and not forced by COHORT_ALGO), single copy runs only when every
  // rank's buffers are shared buffers; otherwise the ring, in the same operation after the address swap.
  // reduce_scatter: single copy only on shared buffers, unless forced.
  const bool shared_only = a == Algo::SingleCopy && !forced && c::single_copy_shared_only(d.coll, d.bytes(), thresholds_);
  COHORT_TRACE(kColl, "{} {} bytes algo {}{}", d.describe(), d.bytes(), c::algo_name(a),
               shared_only ? " if every rank's buffers are shared, else ring" : "");

  switch (d.coll) {
    case Coll::Allreduce:
      run_allreduce(d, a, shared_only, deadline);
      return;
    case Coll::Broadcast:
      if (n == 1) return;
      if (a == Algo::Hierarchical) {
        begin_views(comm, deadline);
        c::broadcast_hierarchical(*local_comm_, *cross_comm_, layout_.members, rp, d.recv.bytes(), d.root,
                                  thresholds_.broadcast_binomial_max, pipeline_segment_);
      } else if (a == Algo::Pipeline) c::broadcast_pipeline(comm, rp, d.recv.bytes(), d.root, pipeline_segment_);
      else c::broadcast_binomial(comm, rp, d.recv.bytes(), d.root);
      return;
    case Coll::Reduce:
      c::reduce_binomial(comm, sp, rp, d.send.count, t, op, d.root);
      if (d.op == ReduceOp::Avg && setup_.rank == d.root) core::scale_avg(rp, d.recv.count, t, n);
      return;
    case Coll::Allgather:
      if (a == Algo::Hierarchical && n > 1) {
        begin_views(comm, deadline);
        if (c::allgather_hierarchical(*local_comm_, *cross_comm_, layout_.members, sp, rp, d.send.bytes(),
                                      host_single_copy(d.recv.bytes())))
          COHORT_TRACE(kColl, "{}: shared outputs on this host: its phase by single copy", d.describe());
      } else if (a == Algo::Direct) {
        c::allgather_direct(comm, sp, rp, d.send.bytes());
      } else if (a != Algo::SingleCopy || !c::allgather_single_copy(comm, sp, rp, d.send.bytes(), shared_only)) {
        if (a == Algo::SingleCopy) d.algo = c::algo_name(Algo::Ring);  // not every rank's input is shared
        c::allgather_ring(comm, sp, rp, d.send.bytes());
      }
      return;
    case Coll::ReduceScatter:
      if (a == Algo::Hierarchical && n > 1) {
        begin_views(comm, deadline);
        if (c::reduce_scatter_hierarchical(*local_comm_, *cross_comm_, layout_.members, sp, rp, d.recv.count, t, op,
                                           d.op == ReduceOp::Avg ? n : 0, host_single_copy(d.send.bytes())))
          COHORT_TRACE(kColl, "{}: shared inputs on this host: its phase by single copy", d.describe());
      } else if (a != Algo::SingleCopy ||
          !c::reduce_scatter_single_copy(comm, sp, rp, d.recv.count, t, op, d.op == ReduceOp::Avg ? n : 0, shared_only)) {
        if (a == Algo::SingleCopy) d.algo = c::algo_name(Algo::Ring);  // not every rank's input is shared
        c::reduce_scatter_ring(comm, sp, rp, d.recv.count, t, op, d.op == ReduceOp::Avg ? n : 0);
      }
      return;
    case Coll::Gather: c::gather_linear(comm, sp, rp, d.send.bytes(), d.root); return;
    case Coll::Scatter: c::scatter_linear(comm, sp, rp, d.recv.bytes(), d.root); return;
    case Coll::Alltoall: c::alltoall_direct(comm, sp, rp, d.send.bytes() / n); return;
    case Coll::Barrier: c::barrier_dissemination(comm); return;
    case Coll::Send:
    case Coll::Recv:
    case Coll::P2PBatch: return;  // run_p2p
  }
}

std::string NativeGroup::record_first_failure(const std::string& why) {
  try {
    Bytes mine(why.begin(), why.end());
    Bytes cur = setup_.store->compare_set("failure", Bytes{}, mine);
    return std::string(cur.begin(), cur.end());
  } catch (const std::exception& e) {
    COHORT_WARN(kColl, "could not record the failure in the store: {}", e.what());  // the store's host may be gone too
    return {};
  }
}

// Point-to-point messages are numbered per (peer, direction), not by the
// group's sequence, since the two ends issue different numbers of them.
void NativeGroup::run_p2p(OpDesc& d, core::Deadline deadline) {
  std::vector<transport::SendOp> sends;
  std::vector<transport::RecvOp> recvs;
  auto add = [&](P2POp::Kind kind, Buffer b, int peer, int tag) {
    const size_t bytes = b.count * dtype_size(b.dtype);
    if (kind == P2POp::Send) {
      transport::MsgKey key{p2p_sent_[peer]++, static_cast<uint32_t>(tag), 1, 0};
      sends.push_back({conns_[peer].get(), static_cast<const uint8_t*>(b.data), bytes, key});
    } else {
      transport::MsgKey key{p2p_recvd_[peer]++, static_cast<uint32_t>(tag), 1, 0};
      recvs.push_back({conns_[peer].get(), bytes, key, transport::Sink::copy_to(b.data)});
    }
  };
  if (d.coll == Coll::Send) add(P2POp::Send, d.send, d.peer, d.tag);
  else if (d.coll == Coll::Recv) add(P2POp::Recv, d.recv, d.peer, d.tag);
  else
    for (const auto& o : d.batch) add(o.kind, o.buf, o.peer, o.tag);
  COHORT_TRACE(kColl, "{} direct", d.describe());
  engine_->run(sends, recvs, deadline);
}

void NativeGroup::fail(const OpDesc& d, std::exception_ptr cause) {
  std::string ctx = fmt::format("rank {} (group {}, world rank {}): {} [{} bytes] failed", setup_.rank, setup_.group_id,
                                setup_.world_ranks[setup_.rank], d.describe(), d.bytes());
  std::exception_ptr wrapped;
  std::string reason;
  try {
    std::rethrow_exception(cause);
  } catch (const transport::MessageMismatch& m) {
    reason = mismatch_message(m);
    wrapped = std::make_exception_ptr(PeerError(fmt::format("{}: {}", ctx, reason), m.peer()));
  } catch (const PeerError& e) {
    reason = e.what();
    wrapped = std::make_exception_ptr(PeerError(fmt::format("{}: {}", ctx, e.what()), e.peer()));
  } catch (const TimeoutError& e) {
    std::string verdict = hang_verdict(d);
    reason = verdict.empty() ? std::string(e.what()) : fmt::format("{} ({})", verdict, e.what());
    wrapped = std::make_exception_ptr(TimeoutError(fmt::format(
        "{}: {}; HINT: a peer is slow, hung or never called this collective; raise COHORT_TIMEOUT if the work is just long",
        ctx, reason)));
  } catch (const InvalidArgument& e) {
    std::rethrow_exception(cause);  // nothing was sent: the group stays usable
  } catch (const std::exception& e) {
    reason = e.what();
    wrapped = std::make_exception_ptr(Error(fmt::format("{}: {}", ctx, e.what())));
  }
  std::string why = fmt::format("rank {} failed in {}: {}", setup_.rank, d.describe(), reason);
  // Record the group's first failure in the store before aborting our
  // connections: a peer that then sees our sockets close can name the root
  // cause instead of just "rank X closed the connection".
  std::string first = record_first_failure(why);
  if (!first.empty() && first != why) {
    try {
      std::rethrow_exception(wrapped);
    } catch (const PeerError& e) {
      wrapped = std::make_exception_ptr(PeerError(fmt::format("{}; first failure in the group: {}", e.what(), first), e.peer()));
    } catch (const TimeoutError& e) {
      wrapped = std::make_exception_ptr(TimeoutError(fmt::format("{}; first failure in the group: {}", e.what(), first)));
    } catch (const Error& e) {
      wrapped = std::make_exception_ptr(Error(fmt::format("{}; first failure in the group: {}", e.what(), first)));
    }
  }
  COHORT_WARN(kColl, "{}: {}", ctx, reason);
  for (auto& c : conns_)
    if (c) c->abort(why);
  broken_ = wrapped;
  std::rethrow_exception(wrapped);
}

}  // namespace cohort::group
