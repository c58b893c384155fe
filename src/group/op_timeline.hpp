// The timeline of collectives (core/timeline.hpp): what NativeGroup records,
// in a few hooks, and how the world group aligns the ranks' clocks.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "cohort/store.hpp"
#include "group/op.hpp"

namespace cohort::group {

// One executed operation: a "queued" async span from submit to start (when it
// went through the queue) on track "group G queue", and a span from start to
// end on track "group G" with op, bytes, algorithm, sequence number, dtype,
// count and group. Called on the thread that ran it, after it ran.
void record_op(const std::string& group_id, int rank, const OpDesc& d, int64_t start_ns, int64_t end_ns, bool failed);

// Collective over the world's ranks at init_process_group, when the timeline is
// on: sets the rank and measures this rank's clock offset to rank 0
// (core/clock_sync.hpp) through `store`. No-op when the timeline is off.
void timeline_setup(Store& store, int rank, int size);

}  // namespace cohort::group
