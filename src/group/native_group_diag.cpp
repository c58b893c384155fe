// NativeGroup's hang diagnosis: the heartbeat and the verdict (hang_verdict.hpp).
#include <algorithm>

#include "core/log.hpp"
#include "group/hang_verdict.hpp"
#include "group/native_group.hpp"

namespace cohort::group {

// Progress thread (or create()), without mu_: publishes this rank's progress
// with the time it did so, every heartbeat period whether or not it changed,
// so that the record's age says how long ago the rank was last alive. The
// progress thread calls it when it has been idle for a period and, when it is
// busy, after an operation once a period has passed since the last one: a
// rank that hangs in the middle of busy work has published progress at most a
// period old. A store that fails is logged, not
// fatal: the collectives do not need it. Heartbeats then stop for good, so that
// a store that is gone (rank 0 finished first) cannot hold this thread in the
// client's reconnect loop, and shutdown() in turn.
void NativeGroup::publish_heartbeat() {
  if (heartbeat_failed_ || !recorder_.enabled()) return;  // a disabled recorder knows nothing to publish
  last_heartbeat_ns_ = FlightRecorder::now_ns();
  try {
    setup_.store->set(heartbeat_key(setup_.rank), heartbeat_record(recorder_.progress()));
  } catch (const std::exception& e) {
    heartbeat_failed_ = true;
    COHORT_INFO(kColl, "group {}: could not publish the heartbeat ({}); no more heartbeats for this group",
                setup_.group_id, e.what());
  }
}

// The thread whose collective timed out, before the group aborts its connections.
std::string NativeGroup::hang_verdict(const OpDesc& d) {
  using collectives::Coll;
  if (d.coll == Coll::Send || d.coll == Coll::Recv || d.coll == Coll::P2PBatch) return {};  // numbered per rank
  if (!recorder_.enabled()) return {};
  HangInputs in;
  in.group_store = setup_.store.get();
  in.world_store = setup_.root_store.get();
  in.recorder = &recorder_;
  in.rank = setup_.rank;
  in.size = setup_.size;
  in.grace = Millis(std::clamp<int64_t>(heartbeat_ms_ + 100, 100, 1500));
  HungCall call;
  call.group_id = setup_.group_id;
  call.seq = d.seq;
  call.fingerprint = d.fingerprint();
  call.count = d.call_count();
  const Millis timeout = d.timeout.count() > 0 ? d.timeout : setup_.timeout;
  call.waited_s = static_cast<double>(timeout.count()) / 1000.0;
  return diagnose_hang(in, call);  // in this rank's error; `cohort run` prints it once for the job
}

}  // namespace cohort::group
