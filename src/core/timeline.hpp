// Per-rank timeline: a Chrome trace (JSON that Perfetto and chrome://tracing
// open) written to COHORT_TIMELINE=DIR/rank<R>.json.
//
// Cost: when COHORT_TIMELINE is unset, enabled() is one relaxed load and
// nothing else runs. When set, each event takes a mutex and appends to an
// in-memory buffer; the buffer goes to the file whenever it holds
// kFlushEvents events, when a group shuts down (flush()) and at exit (close()).
//
// The file is in the trace format's "JSON array" form, one event per line: a
// process killed before close() leaves a file without the closing "]", which
// Perfetto and `cohort trace merge` still read. close() writes the "]".
//
// Times are the steady clock (CLOCK_MONOTONIC) of this host in microseconds;
// the offset to rank 0's clock (clock_sync.hpp) is written into the file as a
// "cohort_clock" metadata event, and `cohort trace merge` applies it.
//
// Thread safety: every function may be called from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

namespace cohort::core::timeline {

namespace detail {
extern std::atomic<bool> g_on;
}

inline bool enabled() {
  return detail::g_on.load(std::memory_order_relaxed);
}

// Steady clock in nanoseconds: the timeline's time base.
int64_t now_ns();

// Events. `track` names a row in the viewer ("group 0", "ddp buckets", ...);
// `args_json` is the text of a JSON object ("{\"seq\":3}") or empty. All are
// no-ops when the timeline is off.
void span(std::string_view track, std::string_view name, std::string_view cat, int64_t start_ns, int64_t end_ns,
          std::string_view args_json = {});
void instant(std::string_view track, std::string_view name, std::string_view cat, int64_t at_ns,
             std::string_view args_json = {});
// An async span (may overlap others on its track): queued operations, bucket allreduces in flight.
void async_span(std::string_view track, std::string_view name, std::string_view cat, uint64_t id, int64_t start_ns,
                int64_t end_ns, std::string_view args_json = {});

// The hot path for collectives: arguments as plain values, formatted only
// when the buffer is written. Strings must be static (coll_name, algo_name,
// dtype_name); `group` is copied.
struct CollArgs {
  const char* op = "";
  const char* algo = "";
  const char* dtype = "";
  uint64_t seq = 0, bytes = 0, count = 0;
  int rank = 0;
  bool queued = false, failed = false;
};
// A track's id, made on first use (callers cache it: the lookup takes the lock).
int track(std::string_view name);
// The collective's run span on `tid` and, when queued_ns != 0, its queued async span on `queue_tid`.
void coll(int tid, int queue_tid, std::string_view group, const CollArgs& a, int64_t queued_ns, int64_t start_ns,
          int64_t end_ns);

// Who this process is: the rank names the file; host and clock offset go into it.
void set_rank(int rank);
void set_clock(int64_t offset_to_rank0_ns, int64_t error_ns, std::string_view method, std::string_view host);

// Writes what is buffered to the file (opens it on first use).
void flush();
// flush() and terminate the JSON; later events are dropped. Registered with atexit.
void close();

// Turns the timeline on for this process, writing into `dir` (tests; normally COHORT_TIMELINE).
void enable(const std::string& dir);

// JSON string escaping for args_json builders.
std::string json_escape(std::string_view s);

}  // namespace cohort::core::timeline
