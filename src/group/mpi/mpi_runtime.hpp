// What every MPI communicator of the backend shares: MPI's initialisation and
// thread level, the mapping of cohort's dtypes and ops to MPI's (with our own
// MPI_Op for f16 and bf16, which MPI has no type for), error checking, the
// process-wide lock that serialises MPI calls, and the timeout watchdog.
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

#include "cohort/process_group.hpp"
#include "group/op.hpp"

namespace cohort::group::mpi {

// Initialises MPI once per process (MPI_Init_thread at COHORT_MPI_THREAD_LEVEL)
// unless the program did it itself, makes the f16/bf16 types and ops, and
// starts the watchdog. Finalises MPI at exit if it initialised it. Any thread;
// the first call initialises.
void ensure_initialized();

// Held around every MPI call of the backend: MPI_THREAD_SERIALIZED allows one
// thread in MPI at a time, and Work::wait may come from another thread than
// the one that issued the call. Uncontended (the common case: one thread
// issues and waits), lock is one atomic exchange and unlock a plain store,
// cheaper than a mutex on the 8-byte path. A thread that finds it held (by
// another in a long MPI_Waitall) yields, then sleeps in growing steps up to
// 1 ms: no busy spinning.
class MpiLock {
 public:
  void lock() {
    if (!held_.exchange(true, std::memory_order_acquire)) return;
    lock_slow();
  }
  void unlock() { held_.store(false, std::memory_order_release); }

 private:
  void lock_slow();
  std::atomic<bool> held_{false};
};
// Inline (as the helpers below): calls between files of a shared library go
// through the PLT, which the 8-byte path notices.
inline MpiLock g_mpi_lock;
inline MpiLock& mpi_lock() {
  return g_mpi_lock;
}

// The f16/bf16 datatypes and ops, made by ensure_initialized.
struct HalfTypes {
  MPI_Datatype f16, bf16;
  MPI_Op ops[kNumReduceOps];  // by ReduceOp (Avg: the Sum op)
};
inline HalfTypes g_half;
// MPI_TAG_UB of MPI_COMM_WORLD, read by ensure_initialized.
inline int g_tag_ub = 32767;

// MPI's datatype for a cohort dtype (f16 and bf16: 16-bit types of our own).
inline MPI_Datatype datatype(DType t) {
  switch (t) {
    case DType::F32:
      return MPI_FLOAT;
    case DType::F64:
      return MPI_DOUBLE;
    case DType::F16:
      return g_half.f16;
    case DType::BF16:
      return g_half.bf16;
    case DType::I8:
      return MPI_INT8_T;
    case DType::U8:
      return MPI_UINT8_T;
    case DType::I32:
      return MPI_INT32_T;
    case DType::I64:
      return MPI_INT64_T;
  }
  return MPI_DATATYPE_NULL;  // validate() rejected unknown dtypes before
}
// MPI's op for a reduction on dtype t: MPI_SUM, ... for the types MPI knows;
// our own commutative MPI_Op for f16 and bf16. Avg maps to Sum (the division
// by the group size follows: core::scale_avg).
inline MPI_Op op_for(ReduceOp op, DType t) {
  if (t == DType::F16 || t == DType::BF16) return g_half.ops[static_cast<int>(op)];
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:
      return MPI_SUM;
    case ReduceOp::Prod:
      return MPI_PROD;
    case ReduceOp::Min:
      return MPI_MIN;
    case ReduceOp::Max:
      return MPI_MAX;
  }
  return MPI_OP_NULL;
}
// Bytes per element (dtype_size without its range check: validated before).
inline size_t elem_size(DType t) {
  static constexpr uint8_t kSize[kNumDTypes] = {4, 8, 2, 2, 1, 1, 4, 8};
  return kSize[static_cast<uint8_t>(t) & 7];
}

// Throws the cohort exception for MPI return code rc of `call` (e.g.
// "MPI_Allreduce") while running d: InvalidArgument for MPI's argument error
// classes, PeerError otherwise. The message names the rank, the operation and
// MPI's own error string.
[[noreturn]] void throw_mpi_error(int rc, const char* call, const OpDesc& d, int rank);
inline void check(int rc, const char* call, const OpDesc& d, int rank) {
  if (__builtin_expect(rc != MPI_SUCCESS, 0)) throw_mpi_error(rc, call, d, rank);
}

// The watchdog of blocking MPI calls. MPI cannot cancel a call that waits for
// a dead or stuck peer, so one that has run longer than its timeout ends the
// process with a message naming it (exit code 124); mpirun then stops the
// other ranks. Only one blocking call runs at a time (mpi_lock), so one slot
// suffices. arm/disarm are a few relaxed stores: the small-message path must
// stay as cheap as MPI's own call.
struct Watch {
  std::atomic<uint64_t> token{0};  // 0: nothing in flight; else a new value per call
  // The call in flight: read by the watchdog only while token stays the same
  // (the caller is then still blocked in MPI, so *op is alive and unchanged).
  std::atomic<const OpDesc*> op{nullptr};
  std::atomic<int64_t> timeout_ms{0};
  std::atomic<int> rank{-1};
  std::atomic<const char*> call{""};
};
inline Watch g_watch;
inline Watch& watch() {
  return g_watch;
}
inline void arm(const OpDesc& d, int rank, Millis timeout, const char* call) {
  static uint64_t next = 0;  // only changed under mpi_lock
  Watch& w = watch();
  w.op.store(&d, std::memory_order_relaxed);
  w.timeout_ms.store(timeout.count(), std::memory_order_relaxed);
  w.rank.store(rank, std::memory_order_relaxed);
  w.call.store(call, std::memory_order_relaxed);
  w.token.store(++next, std::memory_order_release);
}
inline void disarm() {
  watch().token.store(0, std::memory_order_release);
}

// RAII: arm for the scope of one blocking MPI call.
struct Armed {
  Armed(const OpDesc& d, int rank, Millis timeout, const char* call) { arm(d, rank, timeout, call); }
  ~Armed() { disarm(); }
};

// The requested thread level, from COHORT_MPI_THREAD_LEVEL (for docs and logs).
std::string thread_level_name(int level);

}  // namespace cohort::group::mpi
