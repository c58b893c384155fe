// Collective spans and clock alignment for the timeline (op_timeline.hpp).
#include "group/op_timeline.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <vector>

#include "core/clock_sync.hpp"
#include "core/env.hpp"
#include "core/log.hpp"
#include "core/timeline.hpp"

namespace cohort::group {
namespace {

namespace tl = core::timeline;

const core::Knob kClock{"COHORT_TIMELINE_CLOCK", "auto",
                        "how timeline clocks are aligned: auto (offset 0 on rank 0's host, same boot_id; else ping "
                        "rank 0 through the store) or ping (always ping, to check the alignment)"};
constexpr int kPings = 8;

std::string hostname() {
  char buf[256] = {};
  ::gethostname(buf, sizeof buf - 1);
  return buf;
}

}  // namespace

void record_op(const std::string& group_id, int rank, const OpDesc& d, int64_t start_ns, int64_t end_ns, bool failed) {
  // Track ids of the last group seen by this thread: a group runs its operations on one or two threads.
  thread_local std::string cached_group;
  thread_local int tid = 0, queue_tid = 0;
  if (tid == 0 || cached_group != group_id) {
    cached_group = group_id;
    tid = tl::track("group " + group_id);
    queue_tid = tl::track("group " + group_id + " queue");
  }
  const Buffer& b = d.coll == collectives::Coll::Recv || d.coll == collectives::Coll::Broadcast ? d.recv : d.send;
  tl::CollArgs a;
  a.op = collectives::coll_name(d.coll);
  a.algo = d.algo ? d.algo : "direct";
  a.dtype = dtype_name(b.dtype).data();
  a.seq = d.seq;
  a.bytes = d.bytes();
  a.count = b.count;
  a.rank = rank;
  a.queued = d.queued_ns != 0;
  a.failed = failed;
  tl::coll(tid, queue_tid, group_id, a, d.queued_ns, start_ns, end_ns);
}

void timeline_setup(Store& store, int rank, int size) {
  if (!tl::enabled()) return;
  tl::set_rank(rank);
  const std::string host = hostname();
  const std::string boot = core::boot_id();
  const bool force_ping = kClock.str() == "ping";
  if (kClock.str() != "auto" && !force_ping)
    throw InvalidArgument(fmt::format("COHORT_TIMELINE_CLOCK={} is not a choice; use auto or ping", kClock.str()));
  if (size == 1) {
    tl::set_clock(0, 0, "rank 0", host);
    return;
  }
  store.set_string(fmt::format("timeline/boot/{}", rank), boot);
  auto needs_ping = [&](const std::string& other) { return force_ping || boot.empty() || other != boot; };
  if (rank == 0) {
    tl::set_clock(0, 0, "rank 0", host);
    // Serve the pings of every rank on another host, one rank after the other.
    for (int r = 1; r < size; ++r) {
      if (!needs_ping(store.get_string(fmt::format("timeline/boot/{}", r)))) continue;
      for (int i = 0; i < kPings; ++i) {
        store.get(fmt::format("timeline/{}/ping{}", r, i));
        store.set_string(fmt::format("timeline/{}/pong{}", r, i), std::to_string(tl::now_ns()));
      }
    }
    return;
  }
  if (!needs_ping(store.get_string("timeline/boot/0"))) {
    tl::set_clock(0, 0, "same host as rank 0 (boot_id)", host);
    return;
  }
  std::vector<core::PingSample> samples;
  for (int i = 0; i < kPings; ++i) {
    core::PingSample s{};
    s.t_send_ns = tl::now_ns();
    store.set_string(fmt::format("timeline/{}/ping{}", rank, i), "1");
    s.t_remote_ns = std::stoll(store.get_string(fmt::format("timeline/{}/pong{}", rank, i)));
    s.t_recv_ns = tl::now_ns();
    samples.push_back(s);
  }
  const core::ClockOffset off = core::estimate_offset(samples);
  tl::set_clock(off.offset_ns, off.error_ns, fmt::format("ping through the store, +-{} us", off.error_ns / 1000), host);
  COHORT_INFO(kInit, "timeline: clock offset to rank 0 {} us (+-{} us, {} pings through the store)",
              off.offset_ns / 1000, off.error_ns / 1000, kPings);
}

}  // namespace cohort::group
