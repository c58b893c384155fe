#include "group/op.hpp"


#include <fmt/format.h>

namespace cohort::group {

using collectives::Coll;

size_t OpDesc::bytes() const {
  if (coll == Coll::P2PBatch) {
    size_t total = 0;
    for (const auto& o : batch) total += o.buf.count * dtype_size(o.buf.dtype);
    return total;
  }
  size_t s = send.count * dtype_size(send.dtype), r = recv.count * dtype_size(recv.dtype);
  return s > r ? s : r;
}

std::string OpDesc::describe() const {
  // The buffer whose count every rank gives alike (call_count, fingerprint).
  const Buffer& b =
      (coll == Coll::Recv || coll == Coll::Broadcast || coll == Coll::ReduceScatter || coll == Coll::Scatter) ? recv : send;
  std::string extra;
  switch (coll) {
    case Coll::Allreduce:
    case Coll::ReduceScatter: extra = fmt::format(", {}", reduce_op_name(op)); break;
    case Coll::Reduce: extra = fmt::format(", {}, root {}", reduce_op_name(op), root); break;
    case Coll::Broadcast:
    case Coll::Gather:
    case Coll::Scatter: extra = fmt::format(", root {}", root); break;
    case Coll::Send: extra = fmt::format(", to rank {}, tag {}", peer, tag); break;
    case Coll::Recv: extra = fmt::format(", from rank {}, tag {}", peer, tag); break;
    default: break;
  }
  if (coll == Coll::Barrier) return fmt::format("barrier #{}", seq);
  if (coll == Coll::P2PBatch) return fmt::format("batch_isend_irecv #{} ({} ops, {} bytes)", seq, batch.size(), bytes());
  return fmt::format("{} #{} ({} x {}{})", collectives::coll_name(coll), seq, dtype_is_valid(b.dtype) ? dtype_name(b.dtype) : "?",
                     b.count, extra);
}

uint64_t OpDesc::call_count() const {
  switch (coll) {
    case Coll::Broadcast:
    case Coll::ReduceScatter:
    case Coll::Scatter:
    case Coll::Recv: return recv.count;
    case Coll::Barrier:
    case Coll::P2PBatch: return 0;
    default: return send.count;
  }
}

uint32_t OpDesc::fingerprint() const {
  // Scatter: send is ignored (and may be empty) off the root.
  const Buffer& b =
      (coll == Coll::Recv || coll == Coll::Broadcast || coll == Coll::ReduceScatter || coll == Coll::Scatter) ? recv : send;
  const bool reduces = coll == Coll::Allreduce || coll == Coll::Reduce || coll == Coll::ReduceScatter;
  const bool rooted = coll == Coll::Broadcast || coll == Coll::Reduce || coll == Coll::Gather || coll == Coll::Scatter;
  uint32_t dt = coll == Coll::Barrier ? 0 : static_cast<uint32_t>(b.dtype);
  uint32_t o = reduces ? static_cast<uint32_t>(op) : 0;
  uint32_t r = rooted ? static_cast<uint32_t>(root) & 0xfffffu : 0;
  return static_cast<uint32_t>(coll) | (dt << 5) | (o << 9) | (r << 12);
}

std::string describe_call(uint64_t seq, uint32_t fp, uint64_t count) {
  OpDesc d{static_cast<Coll>(fp & 0x1f)};
  d.seq = seq;
  d.op = static_cast<ReduceOp>((fp >> 9) & 0x7);
  d.root = static_cast<int>((fp >> 12) & 0xfffff);
  Buffer b{nullptr, count, static_cast<DType>((fp >> 5) & 0xf)};
  d.send = d.recv = b;
  return d.describe();
}

namespace {

[[noreturn]] void bad(const OpDesc& d, const std::string& msg) {
  throw InvalidArgument(fmt::format("{}: {}", collectives::coll_name(d.coll), msg));
}

void check_buffer(const OpDesc& d, const Buffer& b, const char* which) {
  if (!dtype_is_valid(b.dtype))
    bad(d, fmt::format("{} buffer has an unknown dtype (value {}); use one of f32, f64, f16, bf16, i8, u8, i32, i64", which,
                       static_cast<int>(b.dtype)));
  if (b.count > 0 && b.data == nullptr) bad(d, fmt::format("{} buffer is null but its count is {}", which, b.count));
}

void check_root(const OpDesc& d, int size) {
  if (d.root < 0 || d.root >= size)
    bad(d, fmt::format("root {} is out of range; this group has ranks 0..{}", d.root, size - 1));
}

bool overlaps(const Buffer& a, const Buffer& b) {
  auto* a0 = static_cast<const uint8_t*>(a.data);
  auto* b0 = static_cast<const uint8_t*>(b.data);
  return a0 < b0 + b.bytes() && b0 < a0 + a.bytes();
}

}  // namespace

void check_pieces(Buffer buf, std::span<const InputPiece> pieces) {
  size_t end = 0;  // where the previous piece ended
  for (size_t i = 0; i < pieces.size(); ++i) {
    const InputPiece& p = pieces[i];
    if (p.offset > buf.count || p.count > buf.count - p.offset)
      throw InvalidArgument(fmt::format("allreduce_gathered: piece {} ({} element(s) at offset {}) does not fit the "
                                        "buffer of {} element(s)", i, p.count, p.offset, buf.count));
    if (p.count > 0 && p.data == nullptr)
      throw InvalidArgument(fmt::format("allreduce_gathered: piece {} ({} element(s) at offset {}) has no data", i,
                                        p.count, p.offset));
    if (p.offset < end)
      throw InvalidArgument(fmt::format("allreduce_gathered: piece {} starts at element {}, inside the previous piece "
                                        "(which ends at {}); pass the pieces sorted by offset, without overlap", i,
                                        p.offset, end));
    end = p.offset + p.count;
  }
}

void validate(const OpDesc& d, int rank, int size) {
  using C = Coll;
  if (!reduce_op_is_valid(d.op))
    bad(d, fmt::format("unknown reduce op (value {}); use sum, prod, min, max or avg", static_cast<int>(d.op)));
  const bool uses_send = d.coll != C::Recv && d.coll != C::Broadcast && d.coll != C::Barrier && d.coll != C::P2PBatch;
  const bool uses_recv = d.coll != C::Send && d.coll != C::Barrier && d.coll != C::P2PBatch;
  if (uses_send) check_buffer(d, d.send, "send");
  if (uses_recv) check_buffer(d, d.recv, "recv");
  if (uses_send && uses_recv && d.send.dtype != d.recv.dtype) {
    bool recv_ignored = (d.coll == C::Reduce || d.coll == C::Gather) && rank != d.root;
    bool send_ignored = d.coll == C::Scatter && rank != d.root;
    if (!recv_ignored && !send_ignored)
      bad(d, fmt::format("send is {} but recv is {}; both buffers must have the same dtype", dtype_name(d.send.dtype),
                         dtype_name(d.recv.dtype)));
  }
  const size_t n = static_cast<size_t>(size);
  switch (d.coll) {
    case C::Allreduce:
      if (d.send.count != d.recv.count)
        bad(d, fmt::format("send has {} elements but recv has {}; they must be equal (or pass one buffer for in-place)",
                           d.send.count, d.recv.count));
      if (d.send.data != d.recv.data && overlaps(d.send, d.recv))
        bad(d, "send and recv overlap without being the same buffer; pass one buffer for in-place");
      check_pieces(d.recv, d.pieces);
      break;
    case C::Broadcast: check_root(d, size); break;
    case C::Reduce:
      check_root(d, size);
      if (rank == d.root && d.recv.count != d.send.count)
        bad(d, fmt::format("at the root, recv has {} elements but send has {}; they must be equal", d.recv.count,
                           d.send.count));
      break;
    case C::Allgather:
      if (d.recv.count != n * d.send.count)
        bad(d, fmt::format("recv has {} elements but must have group size x send count = {} x {} = {}", d.recv.count, n,
                           d.send.count, n * d.send.count));
      break;
    case C::ReduceScatter:
      if (d.send.count != n * d.recv.count)
        bad(d, fmt::format("send has {} elements but must have group size x recv count = {} x {} = {}", d.send.count, n,
                           d.recv.count, n * d.recv.count));
      break;
    case C::Gather:
      check_root(d, size);
      if (rank == d.root && d.recv.count != n * d.send.count)
        bad(d, fmt::format("at the root, recv has {} elements but must have group size x send count = {} x {} = {}",
                           d.recv.count, n, d.send.count, n * d.send.count));
      break;
    case C::Scatter:
      check_root(d, size);
      if (rank == d.root && d.send.count != n * d.recv.count)
        bad(d, fmt::format("at the root, send has {} elements but must have group size x recv count = {} x {} = {}",
                           d.send.count, n, d.recv.count, n * d.recv.count));
      break;
    case C::Alltoall:
      if (d.send.count != d.recv.count || d.send.count % n != 0)
        bad(d, fmt::format("send has {} and recv {} elements; both must be equal and divisible by the group size {}",
                           d.send.count, d.recv.count, n));
      break;
    case C::Send:
    case C::Recv:
      if (d.peer < 0 || d.peer >= size)
        bad(d, fmt::format("peer rank {} is out of range; this group has ranks 0..{}", d.peer, size - 1));
      if (d.peer == rank) bad(d, fmt::format("rank {} cannot send to or receive from itself", rank));
      if (d.tag < 0) bad(d, fmt::format("tag {} is negative; tags must be >= 0", d.tag));
      break;
    case C::Barrier: break;
    case C::P2PBatch:
      if (d.batch.empty()) bad(d, "the list of operations is empty");
      for (const auto& o : d.batch) {
        OpDesc one{o.kind == P2POp::Send ? C::Send : C::Recv};
        (o.kind == P2POp::Send ? one.send : one.recv) = o.buf;
        one.peer = o.peer;
        one.tag = o.tag;
        validate(one, rank, size);
      }
      break;
  }
}

}  // namespace cohort::group
