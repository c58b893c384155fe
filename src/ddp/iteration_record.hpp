// What one finalized DDP iteration tells the timeline and the step metrics.
//
// Reducer::finalize() calls record_iteration() on its thread at the end of
// every synced iteration. It (1) writes the iteration's spans into the
// timeline when COHORT_TIMELINE is on (track "ddp": backward, comm wait;
// track "ddp buckets": each bucket's ready instant and its allreduce in
// flight), and (2) keeps the iteration's times for StepMetrics
// (include/cohort/metrics.hpp), which reads them at end_step().
#pragma once

#include <cstdint>
#include <optional>

#include "cohort/ddp.hpp"

namespace cohort::ddp {

struct IterationTimes {
  uint64_t iteration = 0;
  int nranks = 1;
  int64_t first_mark_ns = 0;    // backward's first gradient
  int64_t wait_started_ns = 0;  // finalize() began waiting: backward is over
  int64_t comm_end_ns = 0;      // the last bucket seen complete
  int64_t finalized_ns = 0;
  int64_t exposed_ns = 0;  // waiting for communication after backward: comm_end - wait_started (>= 0)
  int64_t comm_ns = 0;     // union of the buckets' [launched, completed]: communication in flight
  uint64_t bytes = 0;      // gradient bytes reduced
};

// Pure: the times of one iteration (ns on the steady clock).
IterationTimes iteration_times(const IterationStats& st, int nranks);

// Called by Reducer::finalize() (any thread; serialised inside).
void record_iteration(const IterationStats& st, const ProcessGroup& group);

// The most recently recorded iteration of the reducer on `group` (or, when no
// reducer used that group, of the only group that had one), if any.
std::optional<IterationTimes> last_iteration(const ProcessGroup& group);

int64_t to_ns(SteadyTime t);

}  // namespace cohort::ddp
