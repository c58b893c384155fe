// ProcessGroup's default allgather_coalesced and reduce_scatter_coalesced:
// pack, one collective, unpack.
//
// Layouts (n ranks, pairs i with c_i = recv[i].count for reduce_scatter,
// send[i].count for allgather, C = sum of c_i):
//   allgather:      packed send = send[0] | send[1] | ...            (C)
//                   packed recv = rank 0's packed send | rank 1's | ... (n C)
//                   recv[i] block q = packed recv [q C + offset_i, + c_i)
//   reduce_scatter: packed send = for each rank q: send[0] block q | send[1] block q | ... (n C)
//                   packed recv = this rank's reduced blocks, in pair order (C)
// One collective of C (n C) elements instead of one per pair: one launch,
// one synchronisation, and a buffer from allocate_buffer, which on one host
// is shared memory that single copy reads in place. The price is a copy in
// and a copy out of every byte.
#include <fmt/format.h>

#include <cstring>
#include <functional>
#include <mutex>

#include "cohort/process_group.hpp"

namespace cohort {
namespace {

// The inner collective's Work; the unpack runs once, on the first thread
// that sees it complete (wait(), or is_completed() returning true).
class CoalescedWork final : public Work {
 public:
  CoalescedWork(WorkPtr inner, std::shared_ptr<std::byte[]> keep, std::function<void()> unpack)
      : inner_(std::move(inner)), keep_(std::move(keep)), unpack_(std::move(unpack)) {}
  bool is_completed() const override {
    if (!inner_->is_completed()) return false;
    if (!inner_->error()) finish();
    return true;
  }
  void wait(Millis timeout) override {
    inner_->wait(timeout);
    finish();
  }
  std::exception_ptr error() const override { return inner_->error(); }
  std::string describe() const override { return "coalesced " + inner_->describe(); }

 private:
  void finish() const { std::call_once(once_, unpack_); }
  WorkPtr inner_;
  std::shared_ptr<std::byte[]> keep_;
  std::function<void()> unpack_;
  mutable std::once_flag once_;
};

// The pairs' one dtype, after the checks both calls share.
DType check_pairs(const ProcessGroup& g, const char* what, const std::vector<Buffer>& send,
                  const std::vector<Buffer>& recv, size_t n, bool gather) {
  if (g.cuda_device() >= 0)
    throw InvalidArgument(fmt::format("{}: the {} backend moves GPU memory, and this call packs its buffers on the "
                                      "host; issue one {} per tensor there",
                                      what, g.backend_name(), gather ? "allgather" : "reduce_scatter"));
  if (send.size() != recv.size())
    throw InvalidArgument(fmt::format("{}: {} send buffers but {} recv buffers; pass one of each per tensor", what,
                                      send.size(), recv.size()));
  if (send.empty()) return DType::F32;
  const DType t = send[0].dtype;
  for (size_t i = 0; i < send.size(); ++i) {
    if (send[i].dtype != t || recv[i].dtype != t)
      throw InvalidArgument(fmt::format("{}: pair {} is {} -> {}, pair 0 is {}; every pair of one call must have one "
                                        "dtype (issue one call per dtype)",
                                        what, i, dtype_name(send[i].dtype), dtype_name(recv[i].dtype), dtype_name(t)));
    const size_t small = gather ? send[i].count : recv[i].count, big = gather ? recv[i].count : send[i].count;
    if (big != small * n)
      throw InvalidArgument(fmt::format("{}: pair {} has {} elements to send and {} to receive; {} must be {} x {} "
                                        "(the group's size)",
                                        what, i, send[i].count, recv[i].count, gather ? "recv" : "send",
                                        gather ? "send" : "recv", n));
  }
  return t;
}

}  // namespace

WorkPtr ProcessGroup::allgather_coalesced(std::vector<Buffer> send, std::vector<Buffer> recv, AllgatherOptions opts) {
  const size_t n = static_cast<size_t>(size());
  const DType t = check_pairs(*this, "allgather_coalesced", send, recv, n, true);
  const size_t es = dtype_size(t);
  size_t total = 0;
  for (const Buffer& b : send) total += b.count;
  auto packed = allocate_buffer((n + 1) * total * es);  // the packed input, then the packed output
  std::byte* in = packed.get();
  std::byte* out = in + total * es;
  for (size_t i = 0, at = 0; i < send.size(); at += send[i].count, ++i)
    std::memcpy(in + at * es, send[i].data, send[i].count * es);
  WorkPtr inner = allgather(Buffer{in, total, t}, Buffer{out, n * total, t}, opts);
  return std::make_shared<CoalescedWork>(std::move(inner), packed, [=] {
    for (size_t q = 0; q < n; ++q)
      for (size_t i = 0, at = 0; i < send.size(); at += send[i].count, ++i)
        std::memcpy(static_cast<std::byte*>(recv[i].data) + q * send[i].count * es, out + (q * total + at) * es,
                    send[i].count * es);
  });
}

WorkPtr ProcessGroup::reduce_scatter_coalesced(std::vector<Buffer> send, std::vector<Buffer> recv,
                                               ReduceScatterOptions opts) {
  const size_t n = static_cast<size_t>(size());
  const DType t = check_pairs(*this, "reduce_scatter_coalesced", send, recv, n, false);
  const size_t es = dtype_size(t);
  size_t total = 0;
  for (const Buffer& b : recv) total += b.count;
  auto packed = allocate_buffer((n + 1) * total * es);
  std::byte* in = packed.get();
  std::byte* out = in + n * total * es;
  for (size_t q = 0; q < n; ++q)
    for (size_t i = 0, at = 0; i < send.size(); at += recv[i].count, ++i)
      std::memcpy(in + (q * total + at) * es, static_cast<const std::byte*>(send[i].data) + q * recv[i].count * es,
                  recv[i].count * es);
  WorkPtr inner = reduce_scatter(Buffer{in, n * total, t}, Buffer{out, total, t}, opts);
  return std::make_shared<CoalescedWork>(std::move(inner), packed, [=] {
    for (size_t i = 0, at = 0; i < recv.size(); at += recv[i].count, ++i)
      std::memcpy(recv[i].data, out + at * es, recv[i].count * es);
  });
}

}  // namespace cohort
