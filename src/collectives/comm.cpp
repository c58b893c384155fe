#include "collectives/comm.hpp"

namespace cohort::collectives {

using transport::RecvOp;
using transport::SendOp;

void Comm::send(int to, const void* data, size_t bytes) {
  SendOp s{conns_[to], static_cast<const uint8_t*>(data), bytes, key_};
  engine_->run({&s, 1}, {}, deadline_);
}

void Comm::recv(int from, void* data, size_t bytes) {
  RecvOp r{conns_[from], bytes, key_, Sink::copy_to(data)};
  engine_->run({}, {&r, 1}, deadline_);
}

void Comm::recv_reduce(int from, void* dst, const void* other, size_t bytes, DType t, ReduceOp op) {
  RecvOp r{conns_[from], bytes, key_, Sink::reduce_into(dst, other, t, op)};
  engine_->run({}, {&r, 1}, deadline_);
}

void Comm::sendrecv(int to, const void* sdata, size_t sbytes, int from, Sink sink, size_t rbytes) {
  SendOp s{conns_[to], static_cast<const uint8_t*>(sdata), sbytes, key_};
  RecvOp r{conns_[from], rbytes, key_, sink};
  engine_->run({&s, 1}, {&r, 1}, deadline_);
}

void Comm::run(std::vector<SendOp>& sends, std::vector<RecvOp>& recvs) {
  for (auto& s : sends) s.key = key_;
  for (auto& r : recvs) r.key = key_;
  engine_->run(sends, recvs, deadline_);
}

uint8_t* Comm::scratch(size_t bytes, int slot) {
  auto& s = scratch_[slot];
  if (s.size() < bytes) s.resize(bytes);
  return s.data();
}

}  // namespace cohort::collectives
