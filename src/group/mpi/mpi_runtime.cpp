// MPI's initialisation, dtype/op mapping, errors and the watchdog (mpi_runtime.hpp).
#include "group/mpi/mpi_runtime.hpp"

#include <fmt/format.h>
#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "core/env.hpp"
#include "core/log.hpp"
#include "core/reduce.hpp"

namespace cohort::group::mpi {
namespace {

const core::Knob kThreadLevel{"COHORT_MPI_THREAD_LEVEL", "serialized",
                              "mpi backend: thread level asked of MPI_Init_thread (single, funneled, serialized or "
                              "multiple); serialized lets Work::wait run on another thread; single saves Open MPI's "
                              "own locking (about 0.1 us per small call) when one thread issues and waits"};

struct Runtime {
  bool we_initialized = false;
  int provided = MPI_THREAD_SINGLE;
};

Runtime& rt() {
  static Runtime r;
  return r;
}

// Our MPI_Op for f16 and bf16: inout[i] = in[i] (op) inout[i], reduced in f32
// and rounded back by cohort's own kernel (core::reduce), as the native backend does.
template <ReduceOp Op>
void half_op(void* in, void* inout, int* len, MPI_Datatype* type) {
  const DType t = (*type == g_half.bf16) ? DType::BF16 : DType::F16;
  core::reduce(inout, inout, in, static_cast<size_t>(*len), t, Op);
}

int parse_level(const std::string& s) {
  if (s == "single") return MPI_THREAD_SINGLE;
  if (s == "funneled") return MPI_THREAD_FUNNELED;
  if (s == "serialized") return MPI_THREAD_SERIALIZED;
  if (s == "multiple") return MPI_THREAD_MULTIPLE;
  throw InvalidArgument(
      fmt::format("COHORT_MPI_THREAD_LEVEL={}: unknown thread level; use single, funneled, serialized or "
                  "multiple (default serialized)",
                  s));
}

// Wakes every 100 ms and ends the process when the blocking call in flight has
// been the same one for longer than its timeout.
void watchdog_loop() {
  using Clock = std::chrono::steady_clock;
  uint64_t seen = 0;
  Clock::time_point since{};
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    Watch& w = watch();
    const uint64_t token = w.token.load(std::memory_order_acquire);
    const auto now = Clock::now();
    if (token == 0 || token != seen) {
      seen = token;
      since = now;
      continue;
    }
    const int64_t limit = w.timeout_ms.load(std::memory_order_relaxed);
    const auto ran = std::chrono::duration_cast<std::chrono::milliseconds>(now - since).count();
    if (limit <= 0 || ran < limit) continue;
    const OpDesc* op = w.op.load(std::memory_order_relaxed);
    const std::string what = op != nullptr ? describe_call(op->seq, op->fingerprint(), op->call_count()) : "?";
    if (w.token.load(std::memory_order_acquire) != token) continue;  // it completed meanwhile: *op may be gone
    std::fprintf(
        stderr,
        "cohort: rank %d: %s on the mpi backend is still in %s after %lld ms (timeout %lld ms, COHORT_TIMEOUT); "
        "MPI cannot cancel a call, so this process exits (code 124).\n"
        "HINT: a peer died, hangs, or called a different collective; run with COHORT_DEBUG=INFO to see each "
        "rank's calls, or raise COHORT_TIMEOUT if the operation is just slow\n",
        w.rank.load(std::memory_order_relaxed), what.c_str(), w.call.load(std::memory_order_relaxed),
        static_cast<long long>(ran), static_cast<long long>(limit));
    std::fflush(stderr);
    std::_Exit(124);
  }
}

// MPI deletes MPI_COMM_SELF's attributes first thing in MPI_Finalize, whoever
// calls it: the place to free our f16/bf16 types and ops (MPICH warns about
// leaked handles otherwise).
int free_half_types(MPI_Comm, int, void*, void*) {
  HalfTypes& h = g_half;
  MPI_Type_free(&h.f16);
  MPI_Type_free(&h.bf16);
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max}) MPI_Op_free(&h.ops[int(op)]);
  h.ops[int(ReduceOp::Avg)] = MPI_OP_NULL;  // was Sum's
  return MPI_SUCCESS;
}

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

}  // namespace

void MpiLock::lock_slow() {
  int tries = 0;
  for (;;) {
    if (!held_.load(std::memory_order_relaxed) && !held_.exchange(true, std::memory_order_acquire)) return;
    if (++tries < 64) {
      sched_yield();
    } else {
      const int us = tries < 1024 ? 20 : 1000;
      std::this_thread::sleep_for(std::chrono::microseconds(us));
    }
  }
}

std::string thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "single";
    case MPI_THREAD_FUNNELED:
      return "funneled";
    case MPI_THREAD_SERIALIZED:
      return "serialized";
    case MPI_THREAD_MULTIPLE:
      return "multiple";
  }
  return std::to_string(level);
}

void ensure_initialized() {
  static std::once_flag once;
  std::call_once(once, [] {
    Runtime& r = rt();
    int inited = 0;
    MPI_Initialized(&inited);
    const int want = parse_level(kThreadLevel.str());
    if (inited) {
      MPI_Query_thread(&r.provided);
      COHORT_INFO(kInit, "mpi backend: MPI was initialised by the program (thread level {})",
                  thread_level_name(r.provided));
    } else {
      int rc = MPI_Init_thread(nullptr, nullptr, want, &r.provided);
      if (rc != MPI_SUCCESS)
        throw PeerError(
            fmt::format("backend 'mpi': MPI_Init_thread failed (code {}); HINT: start the program with mpirun "
                        "(or as a single process), and check that the MPI it was built with is installed",
                        rc),
            -1);
      r.we_initialized = true;
      std::atexit(finalize_at_exit);
    }
    if (r.provided < want)
      COHORT_WARN(kInit,
                  "mpi backend: asked MPI for thread level {} but it provides {}; issue calls and Work::wait from the "
                  "thread that initialised cohort only",
                  thread_level_name(want), thread_level_name(r.provided));
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    HalfTypes& h = g_half;
    MPI_Type_contiguous(1, MPI_UINT16_T, &h.f16);
    MPI_Type_commit(&h.f16);
    MPI_Type_contiguous(1, MPI_UINT16_T, &h.bf16);
    MPI_Type_commit(&h.bf16);
    MPI_Op_create(&half_op<ReduceOp::Sum>, 1, &h.ops[int(ReduceOp::Sum)]);
    MPI_Op_create(&half_op<ReduceOp::Prod>, 1, &h.ops[int(ReduceOp::Prod)]);
    MPI_Op_create(&half_op<ReduceOp::Min>, 1, &h.ops[int(ReduceOp::Min)]);
    MPI_Op_create(&half_op<ReduceOp::Max>, 1, &h.ops[int(ReduceOp::Max)]);
    h.ops[int(ReduceOp::Avg)] = h.ops[int(ReduceOp::Sum)];
    int free_key = MPI_KEYVAL_INVALID;
    MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, free_half_types, &free_key, nullptr);
    MPI_Comm_set_attr(MPI_COMM_SELF, free_key, nullptr);
    int* ub = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
    if (flag && ub != nullptr) g_tag_ub = *ub;
    std::thread(watchdog_loop).detach();
  });
}

void throw_mpi_error(int rc, const char* call, const OpDesc& d, int rank) {
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0, cls = 0;
  MPI_Error_string(rc, text, &len);
  MPI_Error_class(rc, &cls);
  std::string msg = fmt::format("rank {}: {} failed in {}: {} (MPI error class {})", rank, d.describe(), call,
                                std::string(text, len), cls);
  switch (cls) {
    case MPI_ERR_BUFFER:
    case MPI_ERR_COUNT:
    case MPI_ERR_TYPE:
    case MPI_ERR_TAG:
    case MPI_ERR_RANK:
    case MPI_ERR_ROOT:
    case MPI_ERR_OP:
    case MPI_ERR_ARG:
    case MPI_ERR_TRUNCATE:
      throw InvalidArgument(msg +
                            "; HINT: every rank must call the same collective with matching counts, dtypes and "
                            "roots (a receive must be as large as its send)");
    default:
      throw PeerError(msg + "; HINT: a peer probably died or MPI lost a connection; the MPI job cannot continue", -1);
  }
}

}  // namespace cohort::group::mpi
