// NativeGroup's public entry points: each collective and point-to-point call
// becomes an OpDesc and is submitted (native_group.cpp runs it).
#include "collectives/comm.hpp"
#include "collectives/tuner.hpp"
#include "group/native_group.hpp"

namespace cohort::group {

WorkPtr NativeGroup::allreduce(Buffer send, Buffer recv, AllreduceOptions o) {
  return submit(OpDesc{collectives::Coll::Allreduce, send, recv, o.op, 0, -1, 0, o.timeout});
}
WorkPtr NativeGroup::allreduce_gathered(Buffer buf, std::vector<InputPiece> pieces, AllreduceOptions o) {
  OpDesc d{collectives::Coll::Allreduce, buf, buf, o.op, 0, -1, 0, o.timeout};
  d.pieces = std::move(pieces);
  return submit(std::move(d));
}
std::pair<size_t, size_t> NativeGroup::allreduce_direct_block(size_t count, DType dtype) const {
  // Single copy reads the pieces of this rank's block in place; every other algorithm copies them in first.
  namespace c = collectives;
  const int n = setup_.size;
  if (n == 1 || !single_copy_ || !dtype_is_valid(dtype)) return {0, 0};
  const c::Algo a = algorithm_for(tuner_input(c::Coll::Allreduce, count * dtype_size(dtype))).first;
  if (a != c::Algo::SingleCopy) return {0, 0};
  return {c::chunk_off(count, n, setup_.rank), c::chunk_len(count, n, setup_.rank)};
}
WorkPtr NativeGroup::broadcast(Buffer buf, BroadcastOptions o) {
  return submit(OpDesc{collectives::Coll::Broadcast, buf, buf, ReduceOp::Sum, o.root, -1, 0, o.timeout});
}
WorkPtr NativeGroup::reduce(Buffer send, Buffer recv, ReduceOptions o) {
  return submit(OpDesc{collectives::Coll::Reduce, send, recv, o.op, o.root, -1, 0, o.timeout});
}
WorkPtr NativeGroup::allgather(Buffer send, Buffer recv, AllgatherOptions o) {
  return submit(OpDesc{collectives::Coll::Allgather, send, recv, ReduceOp::Sum, 0, -1, 0, o.timeout});
}
WorkPtr NativeGroup::reduce_scatter(Buffer send, Buffer recv, ReduceScatterOptions o) {
  return submit(OpDesc{collectives::Coll::ReduceScatter, send, recv, o.op, 0, -1, 0, o.timeout});
}
WorkPtr NativeGroup::gather(Buffer send, Buffer recv, GatherOptions o) {
  return submit(OpDesc{collectives::Coll::Gather, send, recv, ReduceOp::Sum, o.root, -1, 0, o.timeout});
}
WorkPtr NativeGroup::scatter(Buffer send, Buffer recv, ScatterOptions o) {
  return submit(OpDesc{collectives::Coll::Scatter, send, recv, ReduceOp::Sum, o.root, -1, 0, o.timeout});
}
WorkPtr NativeGroup::alltoall(Buffer send, Buffer recv, AlltoallOptions o) {
  return submit(OpDesc{collectives::Coll::Alltoall, send, recv, ReduceOp::Sum, 0, -1, 0, o.timeout});
}
WorkPtr NativeGroup::barrier(BarrierOptions o) {
  return submit(OpDesc{collectives::Coll::Barrier, {}, {}, ReduceOp::Sum, 0, -1, 0, o.timeout});
}
WorkPtr NativeGroup::send(Buffer buf, int dst, SendRecvOptions o) {
  return submit(OpDesc{collectives::Coll::Send, buf, {}, ReduceOp::Sum, 0, dst, o.tag, o.timeout});
}
WorkPtr NativeGroup::recv(Buffer buf, int src, SendRecvOptions o) {
  return submit(OpDesc{collectives::Coll::Recv, {}, buf, ReduceOp::Sum, 0, src, o.tag, o.timeout});
}

WorkPtr NativeGroup::batch_isend_irecv(const std::vector<P2POp>& ops, Millis timeout) {
  OpDesc d{collectives::Coll::P2PBatch};
  d.timeout = timeout;
  d.batch = ops;
  return submit(std::move(d));
}

}  // namespace cohort::group
