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
// the one that issued the call.
std::mutex& mpi_lock();

// MPI's datatype for a cohort dtype (f16 and bf16: 16-bit types of our own).
MPI_Datatype datatype(DType t);
// MPI's op for a reduction on dtype t: MPI_SUM, ... for the types MPI knows;
// our own commutative MPI_Op for f16 and bf16. Avg maps to Sum (the division
// by the group size follows: core::scale_avg).
MPI_Op op_for(ReduceOp op, DType t);

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
  std::atomic<uint64_t> seq{0}, count{0};
  std::atomic<uint32_t> fingerprint{0};
  std::atomic<int64_t> timeout_ms{0};
  std::atomic<int> rank{-1};
  std::atomic<const char*> call{""};
};
Watch& watch();
inline void arm(const OpDesc& d, int rank, Millis timeout, const char* call) {
  static uint64_t next = 0;  // only changed under mpi_lock
  Watch& w = watch();
  w.seq.store(d.seq, std::memory_order_relaxed);
  w.count.store(d.call_count(), std::memory_order_relaxed);
  w.fingerprint.store(d.fingerprint(), std::memory_order_relaxed);
  w.timeout_ms.store(timeout.count(), std::memory_order_relaxed);
  w.rank.store(rank, std::memory_order_relaxed);
  w.call.store(call, std::memory_order_relaxed);
  w.token.store((++next << 8) | 1, std::memory_order_release);
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
