// The hang verdict: when a collective times out, say which rank is to blame.
//
// Every rank's group publishes its progress (FlightRecorder::progress: the last
// collective it called and the last one it completed) to the group's store
// under "fr/hb/<rank>": once at creation, then from the progress thread
// whenever it is idle and the progress changed, at most every
// COHORT_FLIGHT_RECORDER_HEARTBEAT. A rank whose operation times out publishes
// its own progress, waits one heartbeat for the others' latest, reads them all
// and forms one sentence:
//
//   hang verdict: rank 1 never entered allreduce #5 (group 0, 1048576 elements,
//   f32); ranks 0,2 have waited 2.0 s in it; rank 1's last completed operation
//   was allreduce #4
//
// The first verdict of the job is kept in the world store ("hang_verdict"
// under the attempt's prefix: kHangVerdictKey) with compare_set, so every rank
// reports the same one and `cohort run` prints it once for the job.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "cohort/store.hpp"
#include "group/flight_recorder.hpp"

namespace cohort::group {

constexpr const char* kHangVerdictKey = "hang_verdict";  // in the world store ("cohort/<attempt>/hang_verdict")
std::string heartbeat_key(int rank);                     // "fr/hb/<rank>" in a group's store
int64_t wall_ms_now();                                   // Progress's wall-clock times: ms since the epoch
Bytes heartbeat_record(Progress p);                      // p stamped as published now, encoded for the store

// The call that timed out, as every rank identifies it.
struct HungCall {
  std::string group_id;
  uint64_t seq = 0;
  uint32_t fingerprint = 0;
  uint64_t count = 0;
  double waited_s = 0;  // how long this rank waited in it
};

// "allreduce #5 (group 0, 1048576 elements, f32)"
std::string describe_hung_call(const HungCall& c);

// Pure: the verdict from every rank's published progress (nullopt: nothing
// published). now_wall_ms is the wall clock (ms since the epoch) used to say
// how long the others have waited.
std::string form_hang_verdict(const HungCall& call, const std::vector<std::optional<Progress>>& ranks,
                              int64_t now_wall_ms);

struct HangInputs {
  Store* group_store = nullptr;  // the group's (prefixed) store: heartbeats
  Store* world_store = nullptr;  // the attempt's root store: the job's verdict
  const FlightRecorder* recorder = nullptr;
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds grace{1000};  // how long to let the others publish their latest progress
};

// Publishes this rank's progress, gathers the others', forms the verdict and
// records it as the job's first; returns the job's verdict (maybe another
// rank's). Never throws: a store that is gone yields what could be learnt.
// Called on the thread whose operation timed out.
std::string diagnose_hang(const HangInputs& in, const HungCall& call);

}  // namespace cohort::group
