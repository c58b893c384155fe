// The checks of the collective suite, shared by every backend's tests: each
// runs on one rank of a group (any size) and checks closed-form expected values
// (docs/design.md habit 7). tests/collectives_test.cpp runs them on the native
// backend with ranks as threads; tests/mpi/mpi_coll_worker.cpp on the mpi
// backend with ranks as processes under mpirun. Every rank of the group must
// run the same checks in the same order (they are collective).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cohort/cohort.hpp"
#include "collectives/algorithms.hpp"
#include "core/element.hpp"
#include "core/stream_copy.hpp"
#include "transport/shared_buffer.hpp"

namespace cohort::checks {

inline const DType kAllTypes[] = {DType::F32, DType::F64, DType::F16, DType::BF16,
                                  DType::I8,  DType::U8,  DType::I32, DType::I64};
inline const ReduceOp kAllOps[] = {ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg};

inline bool is_int(DType t) {
  return t == DType::I8 || t == DType::U8 || t == DType::I32 || t == DType::I64;
}

// The value pattern of the reduction checks. k(i), in {1, 2, 3}, comes from a
// hash of the element's index, so it has no short period: data written at the
// wrong offset (a chunk shifted by any number of elements, a block sent to the
// wrong place) breaks the check, where a pattern like i % 3 + 1 let every
// shift by a multiple of 3 pass. The values are small integers, exact in every
// dtype: bf16 holds integers up to 256 and i8 up to 127, and the largest
// result is a sum of 3 * (1 + ... + 8) = 108 at 8 ranks.
// (SplitMix64's finaliser: every input bit moves every output bit. A plain
// multiplicative hash is not enough: shifts by 9 elements left the top bits of
// most elements unchanged, which collective_checks_test.cpp caught.)
inline uint64_t index_hash(size_t i) {
  uint64_t z = static_cast<uint64_t>(i) + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
inline int k_of(size_t i) { return 1 + static_cast<int>((index_hash(i) >> 33) % 3); }
// prod: rank r contributes 2 where bit r of the element's mask is set, else 1.
// Only ranks 0-5 take part, so a product is at most 64.
inline unsigned prod_mask(size_t i) { return static_cast<unsigned>(index_hash(i) >> 58); }

// Input of rank r at element i for op.
inline double input(int r, size_t i, ReduceOp op, int n) {
  (void)n;
  if (op == ReduceOp::Prod) return r < 6 && ((prod_mask(i) >> r) & 1u) ? 2.0 : 1.0;
  return static_cast<double>((r + 1) * k_of(i));
}

inline double expected(size_t i, ReduceOp op, int n, DType t) {
  const double k = k_of(i);
  switch (op) {
    case ReduceOp::Sum:
      return k * n * (n + 1) / 2;
    case ReduceOp::Prod: {
      const unsigned ranks = (1u << std::min(n, 6)) - 1;
      return std::ldexp(1.0, std::popcount(prod_mask(i) & ranks));
    }
    case ReduceOp::Min:
      return k;
    case ReduceOp::Max:
      return k * n;
    case ReduceOp::Avg: {
      double s = k * n * (n + 1) / 2;
      return is_int(t) ? std::floor(s / n) : s / n;
    }
  }
  return 0;
}

inline void store_value(void* p, size_t i, DType t, double v) {
  core::store_element(p, i, t, v);
}
inline double load_value(const void* p, size_t i, DType t) {
  return core::load_element(p, i, t);
}

struct Vec {
  std::vector<uint8_t> bytes;
  DType t;
  size_t count;
  Vec(size_t n, DType dt) : bytes(n * dtype_size(dt) + 1), t(dt), count(n) {}
  Buffer buf() { return Buffer{bytes.data(), count, t}; }
  void set(size_t i, double v) { store_value(bytes.data(), i, t, v); }
  double get(size_t i) const { return load_value(bytes.data(), i, t); }
};

// Reports the first few wrong elements (with rank) instead of thousands of lines.
#define EXPECT_ELEMS(count, actual_expr, expected_expr, what)                                                        \
  do {                                                                                                               \
    int wrong_ = 0;                                                                                                  \
    for (size_t i = 0; i < (count) && wrong_ < 3; ++i) {                                                             \
      double a_ = (actual_expr), e_ = (expected_expr);                                                               \
      if (a_ != e_) {                                                                                                \
        ++wrong_;                                                                                                    \
        ADD_FAILURE() << what << " rank " << pg.rank() << " element " << i << ": got " << a_ << ", expected " << e_; \
      }                                                                                                              \
    }                                                                                                                \
  } while (0)

// 0, 1, odd, not divisible by n, and one above the recursive-doubling threshold.
inline std::vector<size_t> counts_for(int n) {
  return {0, 1, 7, static_cast<size_t>(3 * n + 1), 40000};
}

inline void check_allreduce_every_dtype_and_op(ProcessGroup& pg) {
  const int n = pg.size();
  for (DType t : kAllTypes)
    for (ReduceOp op : kAllOps)
      for (size_t count : counts_for(n)) {
        for (int inplace = 0; inplace < 2; ++inplace) {
          Vec in(count, t), out(count, t);
          for (size_t i = 0; i < count; ++i) in.set(i, input(pg.rank(), i, op, n));
          Vec& dst = inplace ? in : out;
          pg.allreduce(in.buf(), dst.buf(), {.op = op})->wait();
          EXPECT_ELEMS(count, dst.get(i), expected(i, op, n, t),
                       "allreduce " << dtype_name(t) << " " << reduce_op_name(op) << " count " << count
                                    << (inplace ? " in-place" : ""));
        }
      }
}

inline void check_allreduce_large_f32(ProcessGroup& pg) {
  const int n = pg.size();
  const size_t count = (16u << 20) / 4 + 5;  // > 16 MiB, not divisible by n
  Vec in(count, DType::F32), out(count, DType::F32);
  for (size_t i = 0; i < count; ++i) in.set(i, input(pg.rank(), i, ReduceOp::Sum, n));
  pg.allreduce(in.buf(), out.buf())->wait();
  EXPECT_ELEMS(count, out.get(i), expected(i, ReduceOp::Sum, n, DType::F32), "large allreduce");
}

// Allreduces on buffers from allocate_buffer (shared memory on one host: the
// single-copy allreduce loads and stores peers' bytes directly), first on
// every rank, then on even ranks only (odd ranks' buffers go through
// process_vm_readv/writev in the same call). Each size runs twice on the same
// buffers (the second time through the cached mappings).
inline void check_allreduce_shared_buffers(ProcessGroup& pg) {
  const int n = pg.size();
  // All shared; even ranks only; the first half only (on 2 hosts of n/2 ranks: one host's ranks
  // all shared, the other's none, so the hosts run their local phases in different forms).
  for (int mixed = 0; mixed < 3; ++mixed) {
    const bool shared = mixed == 0 || (mixed == 1 && pg.rank() % 2 == 0) || (mixed == 2 && pg.rank() < n / 2);
    const char* which = mixed == 1 ? " (even ranks shared)" : mixed == 2 ? " (first half shared)" : "";
    auto alloc = [&](size_t bytes) {
      return shared ? pg.allocate_buffer(bytes) : std::shared_ptr<std::byte[]>(new std::byte[bytes + 1]());
    };
    for (DType t : {DType::F32, DType::F16, DType::I64})
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max})
        // Small; 256 KiB-1 MiB for 2-byte and 4-byte types (single copy only if all are shared); above 1 MiB.
        for (size_t count : {size_t(3 * n + 1), size_t(100000), size_t((1u << 20) / 2 + 5)}) {
          const size_t es = dtype_size(t);
          auto in = alloc(count * es), out = alloc(count * es);
          for (int inplace = 0; inplace < 2; ++inplace)
            for (int again = 0; again < 2; ++again) {
              for (size_t i = 0; i < count; ++i) store_value(in.get(), i, t, input(pg.rank(), i, op, n));
              void* dst = inplace ? in.get() : out.get();
              pg.allreduce(Buffer{in.get(), count, t}, Buffer{dst, count, t}, {.op = op})->wait();
              EXPECT_ELEMS(count, load_value(dst, i, t), expected(i, op, n, t),
                           "shared-buffer allreduce " << dtype_name(t) << " " << reduce_op_name(op) << " count " << count
                                                      << (inplace ? " in-place" : "") << which);
            }
        }
  }
}

// allreduce_gathered: part of the input sits in pieces outside the buffer
// (the buffer holds a poison value there). Pieces cross the ranks' blocks, one
// is empty, one sits in place, and the last ends at the buffer's end; on a
// single-copy group a rank reads the pieces of its own block in place. The
// pieces must come back unchanged. On shared and ordinary buffers.
inline void check_allreduce_gathered(ProcessGroup& pg) {
  const int n = pg.size(), r = pg.rank();
  for (int shared = 0; shared < 2; ++shared)
    for (DType t : {DType::F32, DType::F64})
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg})
        for (size_t count : {size_t(3 * n + 11), size_t(100000), size_t((1u << 20) / 2 + 5)}) {
          const size_t es = dtype_size(t);
          auto buf = shared ? pg.allocate_buffer(count * es) : std::shared_ptr<std::byte[]>(new std::byte[count * es]());
          const auto [first, len] = pg.allreduce_direct_block(count, t);
          EXPECT_LE(first + len, count) << "allreduce_direct_block(" << count << ")";
          if (n == 1) {
            EXPECT_EQ(len, 0u) << "one rank reads nothing in place";
          }
          for (int again = 0; again < 2; ++again) {
            const size_t a = count / 5, b = 2 * count / 5, c = std::min(3 * count / 5 + 7, count - 5);
            std::vector<std::pair<size_t, size_t>> ranges = {{0, a}, {b, b}, {b, c}, {c + 1, c + 2}, {count - 3, count}};
            std::vector<Vec> srcs;
            std::vector<InputPiece> pieces;
            for (size_t i = 0; i < count; ++i) store_value(buf.get(), i, t, input(r, i, op, n));
            for (auto [lo, hi] : ranges) {
              srcs.emplace_back(hi - lo, t);
              for (size_t i = lo; i < hi; ++i) {
                srcs.back().set(i - lo, input(r, i, op, n));
                store_value(buf.get(), i, t, -12345);  // must not be read
              }
            }
            for (size_t k = 0; k < ranges.size(); ++k)
              pieces.push_back({ranges[k].first, ranges[k].second - ranges[k].first, srcs[k].bytes.data()});
            // One piece already in place (its data is the buffer itself).
            store_value(buf.get(), c, t, input(r, c, op, n));
            pieces.insert(pieces.begin() + 3, InputPiece{c, 1, buf.get() + c * es});
            pg.allreduce_gathered(Buffer{buf.get(), count, t}, pieces, {.op = op})->wait();
            EXPECT_ELEMS(count, load_value(buf.get(), i, t), expected(i, op, n, t),
                         "allreduce_gathered " << dtype_name(t) << " " << reduce_op_name(op) << " count " << count
                                               << (shared ? " shared" : ""));
            for (size_t k = 0; k < ranges.size(); ++k)
              EXPECT_ELEMS(srcs[k].count, srcs[k].get(i), input(r, ranges[k].first + i, op, n),
                           "piece " << k << " after allreduce_gathered count " << count);
          }
        }
  // Bad pieces throw at the call, on every rank alike (nothing is issued).
  Vec v(10, DType::F32);
  float x[4] = {};
  EXPECT_THROW(pg.allreduce_gathered(v.buf(), {{8, 4, x}}), InvalidArgument);
  EXPECT_THROW(pg.allreduce_gathered(v.buf(), {{0, 4, x}, {3, 1, x}}), InvalidArgument);
  EXPECT_THROW(pg.allreduce_gathered(v.buf(), {{2, 1, nullptr}}), InvalidArgument);
}

inline void check_broadcast_reduce_every_root(ProcessGroup& pg) {
  const int n = pg.size();
  for (size_t count : {size_t(0), size_t(1), size_t(3 * n + 1), size_t(300000)})
    for (int root = 0; root < n; ++root) {
      Vec b(count, DType::I32);
      // root * 10^6 + i: no two elements alike (i32 holds it), so a misplaced piece shows
      for (size_t i = 0; i < count; ++i) b.set(i, pg.rank() == root ? double(root * 1000000 + i) : -1);
      pg.broadcast(b.buf(), {.root = root})->wait();
      EXPECT_ELEMS(count, b.get(i), double(root * 1000000 + i), "broadcast root " << root << " count " << count);

      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max}) {
        Vec in(count, DType::F32), out(count, DType::F32);
        for (size_t i = 0; i < count; ++i) in.set(i, input(pg.rank(), i, op, n));
        pg.reduce(in.buf(), out.buf(), {.op = op, .root = root})->wait();
        if (pg.rank() == root)
          EXPECT_ELEMS(count, out.get(i), expected(i, op, n, DType::F32), "reduce root " << root << " count " << count);
      }
    }
}

inline void check_allgather_reduce_scatter(ProcessGroup& pg) {
  const int n = pg.size();
  for (size_t per : {size_t(0), size_t(1), size_t(5), size_t(70000)}) {
    Vec in(per, DType::F64), out(per * n, DType::F64);
    for (size_t i = 0; i < per; ++i) in.set(i, pg.rank() * 1e6 + i);
    pg.allgather(in.buf(), out.buf())->wait();
    EXPECT_ELEMS(per * n, out.get(i), double((i / per) * 1e6 + i % per), "allgather per " << per);

    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Min, ReduceOp::Avg}) {
      Vec rin(per * n, DType::F32), rout(per, DType::F32);
      for (size_t i = 0; i < per * n; ++i) rin.set(i, input(pg.rank(), i, op, n));
      pg.reduce_scatter(rin.buf(), rout.buf(), {.op = op})->wait();
      EXPECT_ELEMS(per, rout.get(i), expected(pg.rank() * per + i, op, n, DType::F32),
                   "reduce_scatter " << reduce_op_name(op) << " per " << per);
    }

    // In place, as ZeRO and FSDP call them: allgather's input is this rank's
    // block of the output, reduce_scatter's output is its block of the input;
    // on ordinary memory and on shared buffers (single copy runs on those).
    for (bool shared : {false, true}) {
      const size_t elems = per * n;
      auto mem = [&](size_t bytes) {
        return shared ? pg.allocate_buffer(bytes) : std::shared_ptr<std::byte[]>(new std::byte[bytes + 1]());
      };
      auto gather_mem = mem(elems * sizeof(double));
      auto* gather_io = reinterpret_cast<double*>(gather_mem.get());
      for (size_t i = 0; i < elems; ++i) gather_io[i] = -1;
      for (size_t i = 0; i < per; ++i) gather_io[pg.rank() * per + i] = pg.rank() * 1e6 + i;
      pg.allgather(Buffer{gather_io + pg.rank() * per, per, DType::F64}, Buffer{gather_io, elems, DType::F64})->wait();
      EXPECT_ELEMS(elems, gather_io[i], double((i / per) * 1e6 + i % per),
                   "in-place allgather per " << per << (shared ? " (shared)" : ""));

      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
        auto scatter_mem = mem(elems * sizeof(float));
        Vec in(elems, DType::F32);
        for (size_t i = 0; i < elems; ++i) in.set(i, input(pg.rank(), i, op, n));
        auto* scatter_io = reinterpret_cast<float*>(scatter_mem.get());
        std::memcpy(scatter_io, in.bytes.data(), elems * sizeof(float));
        pg.reduce_scatter(Buffer{scatter_io, elems, DType::F32}, Buffer{scatter_io + pg.rank() * per, per, DType::F32},
                          {.op = op})
            ->wait();
        EXPECT_ELEMS(per, scatter_io[pg.rank() * per + i], expected(pg.rank() * per + i, op, n, DType::F32),
                     "in-place reduce_scatter " << reduce_op_name(op) << " per " << per << (shared ? " (shared)" : ""));
      }
    }
  }
}

// Allgathers into shared outputs large enough that single copy pushes each
// block into every output: with memcpy (from allgather_push_min()) and with
// streaming stores (from core::stream_copy_min(), x86-64 only; core/stream_copy.hpp).
// Each size with an input that is ordinary memory, outputs at an odd address
// and an odd block size (the copy's unaligned head and tail), then in place.
inline void check_allgather_pushing(ProcessGroup& pg) {
  const int n = pg.size(), me = pg.rank();
  std::vector<size_t> totals;
  if (collectives::allgather_push_min() != SIZE_MAX) totals.push_back(collectives::allgather_push_min());
  if (core::stream_copy_min() != SIZE_MAX) totals.push_back(core::stream_copy_min());
  for (size_t at_least : totals) {
    const size_t per = at_least / n + 13, total = per * n;
    auto value = [](size_t rank, size_t i) { return static_cast<uint8_t>(rank * 37 + i * 11 + i / 4099); };
    std::vector<uint8_t> in(per), want(total);
    for (size_t i = 0; i < per; ++i) in[i] = value(me, i);
    for (size_t i = 0; i < total; ++i) want[i] = value(i / per, i % per);
    auto out_mem = pg.allocate_buffer(total + 3);
    uint8_t* out = reinterpret_cast<uint8_t*>(out_mem.get()) + 3;
    ASSERT_NE(transport::find_shared_buffer(out, total).id, 0u) << "the output must be a shared buffer to be pushed into";
    auto expect_gathered = [&](const std::string& what) {
      if (std::memcmp(out, want.data(), total) == 0) return;
      const size_t i = static_cast<size_t>(std::mismatch(out, out + total, want.begin()).first - out);
      FAIL() << what << " of " << total << " bytes: byte " << i << " (block " << i / per << ") is " << int(out[i])
             << ", not " << int(want[i]);
    };
    for (int rep = 0; rep < 2; ++rep) {  // the second time into a buffer the peers have mapped already
      std::memset(out, 0xEE, total);
      pg.allgather(Buffer{in.data(), per, DType::U8}, Buffer{out, total, DType::U8})->wait();
      expect_gathered("out-of-place allgather, rep " + std::to_string(rep));
    }
    std::memset(out, 0xEE, total);
    std::memcpy(out + me * per, in.data(), per);
    pg.allgather(Buffer{out + me * per, per, DType::U8}, Buffer{out, total, DType::U8})->wait();
    expect_gathered("in-place allgather");
  }
}

inline void check_gather_scatter_alltoall(ProcessGroup& pg) {
  const int n = pg.size();
  const int me = pg.rank();
  for (size_t per : {size_t(0), size_t(1), size_t(9), size_t(50000)}) {
    for (int root = 0; root < n; ++root) {
      Vec in(per, DType::U8), out(me == root ? per * n : 0, DType::U8);
      for (size_t i = 0; i < per; ++i) in.set(i, (me * 31 + i) % 251);
      pg.gather(in.buf(), out.buf(), {.root = root})->wait();
      if (me == root) EXPECT_ELEMS(per * n, out.get(i), double(((i / per) * 31 + i % per) % 251), "gather per " << per);

      Vec sin(me == root ? per * n : 0, DType::I64), sout(per, DType::I64);
      for (size_t i = 0; i < sin.count; ++i) sin.set(i, double(i * 3 + root));
      pg.scatter(sin.buf(), sout.buf(), {.root = root})->wait();
      EXPECT_ELEMS(per, sout.get(i), double((me * per + i) * 3 + root), "scatter per " << per);
    }
    for (int inplace = 0; inplace < 2; ++inplace) {
      Vec a(per * n, DType::I32), b(per * n, DType::I32);
      // block j of rank r holds r * 1000 + j * 10 + element index
      for (size_t i = 0; i < per * n; ++i) a.set(i, double(me * 1000 + (i / per) * 10 + i % per));
      Vec& dst = inplace ? a : b;
      pg.alltoall(a.buf(), dst.buf())->wait();
      // block i of the result came from rank i: i * 1000 + me * 10 + element
      EXPECT_ELEMS(per * n, dst.get(i), double((i / per) * 1000 + me * 10 + i % per), "alltoall per " << per);
    }
  }
  for (int k = 0; k < 5; ++k) pg.barrier()->wait();
}

inline void check_send_recv_ring(ProcessGroup& pg) {
  const int n = pg.size();
  const int me = pg.rank(), right = (me + 1) % n, left = (me - 1 + n) % n;
  for (size_t count : {size_t(0), size_t(1), size_t(100000)}) {
    std::vector<int32_t> out(count), in(count, -1);
    for (size_t i = 0; i < count; ++i) out[i] = static_cast<int32_t>(me * 7 + i);
    // Even ranks send first, odd ranks receive first (sends are synchronous past the buffering).
    if (me % 2 == 0) {
      auto w = pg.send(buffer(out), right, {.tag = 3});
      auto r = pg.recv(buffer(in), left, {.tag = 3});
      w->wait();
      r->wait();
    } else {
      auto r = pg.recv(buffer(in), left, {.tag = 3});
      auto w = pg.send(buffer(out), right, {.tag = 3});
      r->wait();
      w->wait();
    }
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(in[i], static_cast<int32_t>(left * 7 + i));
  }
}

inline void check_many_async_ops_complete_in_order(ProcessGroup& pg) {
  const int n = pg.size();
  std::vector<std::vector<float>> bufs(20, std::vector<float>(100000));
  std::vector<WorkPtr> works;
  for (size_t k = 0; k < bufs.size(); ++k) {
    std::fill(bufs[k].begin(), bufs[k].end(), float(pg.rank() + k));
    works.push_back(pg.allreduce(buffer(bufs[k])));
  }
  for (size_t k = 0; k < bufs.size(); ++k) {
    works[k]->wait();
    EXPECT_TRUE(works[k]->is_completed());
    EXPECT_EQ(bufs[k][99999], float(n * (n - 1) / 2 + n * k));
  }
}

}  // namespace cohort::checks
