// The collectives of `cohort bench`: sizes, busbw factors, data patterns and checks.
#include "bench_colls.hpp"

#include <cmath>
#include <cstring>

#include "core/element.hpp"

namespace cohort::tools {
namespace {

void same(size_t c, int, size_t& s, size_t& r) { s = r = c; }
void gathered(size_t c, int n, size_t& s, size_t& r) { s = c / n; r = s * n; }    // size = output
void scattered(size_t c, int n, size_t& s, size_t& r) { r = c / n; s = r * n; }   // size = input
void blocks(size_t c, int n, size_t& s, size_t& r) { s = r = c / n * n; }
void rooted_gather(size_t c, int n, size_t& s, size_t& r) { s = c / n; r = s * n; }
double one(int) { return 1.0; }
double ring2(int n) { return 2.0 * (n - 1) / n; }
double ring1(int n) { return double(n - 1) / n; }

const BenchColl kColls[] = {
    {"allreduce", true, false, same, ring2},
    {"broadcast", false, true, same, one},
    {"reduce", true, true, same, one},
    {"allgather", false, false, gathered, ring1},
    {"reduce_scatter", true, false, scattered, ring1},
    {"alltoall", false, false, blocks, ring1},
    {"gather", false, true, rooted_gather, ring1},
    {"scatter", false, true, scattered, ring1},
    {"sendrecv", false, false, same, one},
};

bool small_type(DType t) { return t == DType::F16 || t == DType::BF16 || t == DType::I8 || t == DType::U8; }

// Reduction inputs: exact in every dtype for up to 8 ranks (and beyond for the wide types).
double red_input(int r, size_t i, ReduceOp op, int n, DType t) {
  if (op == ReduceOp::Prod) return static_cast<size_t>(r) == i % n ? 2.0 : 1.0;
  double k = small_type(t) ? double(i % 3 + 1) : double(i % 13 + 1);
  return (r + 1) * k;
}
double red_expected(size_t i, ReduceOp op, int n, DType t) {
  double k = small_type(t) ? double(i % 3 + 1) : double(i % 13 + 1);
  double sum = k * n * (n + 1) / 2;
  switch (op) {
    case ReduceOp::Sum: return sum;
    case ReduceOp::Prod: return 2.0;
    case ReduceOp::Min: return k;
    case ReduceOp::Max: return k * n;
    case ReduceOp::Avg: {
      bool integer = t == DType::I8 || t == DType::U8 || t == DType::I32 || t == DType::I64;
      return integer ? std::floor(sum / n) : sum / n;
    }
  }
  return 0;
}
// Data-movement inputs: element j of rank r's buffer.
double mov_value(int r, size_t j) { return double((r * 7 + j) % 97); }

void put(void* p, size_t i, DType t, double v) { core::store_element(p, i, t, v); }
double get(const void* p, size_t i, DType t) { return core::load_element(p, i, t); }

}  // namespace

const BenchColl* find_bench_coll(const std::string& name) {
  for (const auto& c : kColls)
    if (name == c.name) return &c;
  return nullptr;
}

std::vector<std::string> bench_coll_names() {
  std::vector<std::string> v;
  for (const auto& c : kColls) v.push_back(c.name);
  return v;
}

WorkPtr run_once(ProcessGroup& pg, const BenchCase& c, Buffer send, Buffer recv) {
  const std::string name = c.coll->name;
  const int n = pg.size(), me = pg.rank();
  if (name == "allreduce") return pg.allreduce(send, c.in_place ? send : recv, {.op = c.op});
  if (name == "broadcast") return pg.broadcast(send, {.root = c.root});  // cohort's broadcast is in place
  if (name == "reduce") return pg.reduce(send, c.in_place ? send : recv, {.op = c.op, .root = c.root});
  if (name == "allgather") {
    Buffer s = c.in_place ? Buffer{static_cast<uint8_t*>(recv.data) + me * send.bytes(), send.count, send.dtype} : send;
    return pg.allgather(s, recv);
  }
  if (name == "reduce_scatter") {
    Buffer r = c.in_place ? Buffer{static_cast<uint8_t*>(send.data) + me * recv.bytes(), recv.count, recv.dtype} : recv;
    return pg.reduce_scatter(send, r, {.op = c.op});
  }
  if (name == "alltoall") return pg.alltoall(send, c.in_place ? send : recv);
  if (name == "gather") return pg.gather(send, recv, {.root = c.root});
  if (name == "scatter") return pg.scatter(send, recv, {.root = c.root});
  // sendrecv: everyone sends to the right and receives from the left.
  return pg.batch_isend_irecv({{P2POp::Send, send, (me + 1) % n}, {P2POp::Recv, recv, (me - 1 + n) % n}});
}

void fill_inputs(ProcessGroup& pg, const BenchCase& c, Buffer send, Buffer recv) {
  const int me = pg.rank(), n = pg.size();
  const std::string name = c.coll->name;
  for (size_t i = 0; i < recv.count; ++i) put(recv.data, i, c.dtype, -1);
  for (size_t i = 0; i < send.count; ++i) {
    double v;
    if (c.coll->reduces) v = red_input(me, i, c.op, n, c.dtype);
    else if (name == "broadcast") v = me == c.root ? mov_value(me, i) : -1;
    else v = mov_value(me, i);
    put(send.data, i, c.dtype, v);
  }
  if (c.in_place && name == "allgather") {
    size_t per = send.count;
    for (size_t j = 0; j < per; ++j) put(recv.data, me * per + j, c.dtype, mov_value(me, j));
  }
}

int64_t count_wrong(ProcessGroup& pg, const BenchCase& c, Buffer send, Buffer recv) {
  const int me = pg.rank(), n = pg.size();
  const std::string name = c.coll->name;
  int64_t wrong = 0;
  auto check = [&](const Buffer& b, size_t i, double want) { wrong += get(b.data, i, c.dtype) != want; };
  Buffer out = c.in_place ? send : recv;
  if (name == "allreduce") {
    for (size_t i = 0; i < out.count; ++i) check(out, i, red_expected(i, c.op, n, c.dtype));
  } else if (name == "reduce") {
    if (me == c.root)
      for (size_t i = 0; i < out.count; ++i) check(out, i, red_expected(i, c.op, n, c.dtype));
  } else if (name == "broadcast") {
    for (size_t i = 0; i < send.count; ++i) check(send, i, mov_value(c.root, i));
  } else if (name == "allgather") {
    size_t per = send.count;
    for (size_t i = 0; i < recv.count; ++i) check(recv, i, mov_value(int(i / per), i % per));
  } else if (name == "reduce_scatter") {
    size_t per = recv.count;
    Buffer r = c.in_place ? Buffer{static_cast<uint8_t*>(send.data) + me * recv.bytes(), per, c.dtype} : recv;
    for (size_t j = 0; j < per; ++j) check(r, j, red_expected(me * per + j, c.op, n, c.dtype));
  } else if (name == "alltoall") {
    size_t per = out.count / n;
    for (size_t i = 0; i < out.count; ++i) check(out, i, mov_value(int(i / per), me * per + i % per));
  } else if (name == "gather") {
    size_t per = send.count;
    if (me == c.root)
      for (size_t i = 0; i < recv.count; ++i) check(recv, i, mov_value(int(i / per), i % per));
  } else if (name == "scatter") {
    for (size_t j = 0; j < recv.count; ++j) check(recv, j, mov_value(c.root, me * recv.count + j));
  } else {  // sendrecv
    int left = (me - 1 + n) % n;
    for (size_t j = 0; j < recv.count; ++j) check(recv, j, mov_value(left, j));
  }
  return wrong;
}

}  // namespace cohort::tools
