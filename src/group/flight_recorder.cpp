#include "group/flight_recorder.hpp"

#include <fmt/format.h>
#include <time.h>

#include <chrono>
#include <cstdio>

#include "cohort/error.hpp"
#include "core/env.hpp"
#include "group/op.hpp"

namespace cohort::group {
namespace {

const core::Knob kEntries{
    "COHORT_FLIGHT_RECORDER_ENTRIES", "256",
    "collectives each group remembers (a ring, for the hang verdict and failure reports); 0 turns the "
    "recorder and the heartbeat off",
    core::KnobKind::Int};
const core::Knob kHeartbeat{"COHORT_FLIGHT_RECORDER_HEARTBEAT", "1s",
                            "how often a rank, idle or busy, publishes its last called / completed collective to the "
                            "store (for the hang verdict); 0 turns the heartbeat off",
                            core::KnobKind::Seconds};

constexpr auto kRelaxed = std::memory_order_relaxed;

}  // namespace

const char* flight_state_name(FlightState s) {
  switch (s) {
    case FlightState::Queued:
      return "queued";
    case FlightState::Started:
      return "started";
    case FlightState::Completed:
      return "completed";
    case FlightState::Failed:
      return "failed";
  }
  return "?";
}

std::string FlightEntry::describe() const {
  return describe_call(seq, fingerprint, count);
}

std::string Progress::encode() const {
  return fmt::format("v2 {} {} {} {} {} {} {} {}", called, called_fp, called_count, called_wall_ms, completed,
                     completed_fp, completed_count, published_wall_ms);
}

// v2 adds the publication time; a v1 record (an older cohort) still reads, its age unknown.
std::optional<Progress> Progress::decode(const std::string& s) {
  Progress p;
  long long called = 0, wall = 0, completed = 0, published = 0;
  unsigned long long ccount = 0, dcount = 0;
  unsigned cfp = 0, dfp = 0;
  int used = 0;
  const bool v2 = s.rfind("v2 ", 0) == 0;
  const int fields = v2 ? std::sscanf(s.c_str(), "v2 %lld %u %llu %lld %lld %u %llu %lld%n", &called, &cfp, &ccount,
                                      &wall, &completed, &dfp, &dcount, &published, &used)
                        : std::sscanf(s.c_str(), "v1 %lld %u %llu %lld %lld %u %llu%n", &called, &cfp, &ccount, &wall,
                                      &completed, &dfp, &dcount, &used);
  if (fields != (v2 ? 8 : 7) || static_cast<size_t>(used) != s.size()) return std::nullopt;
  p.called = called;
  p.called_fp = cfp;
  p.called_count = ccount;
  p.called_wall_ms = wall;
  p.completed = completed;
  p.completed_fp = dfp;
  p.completed_count = dcount;
  p.published_wall_ms = published;
  return p;
}

namespace {
size_t round_up_pow2(size_t n) {
  size_t p = 1;
  while (p < n) p <<= 1;
  return p;
}
}  // namespace

FlightRecorder::FlightRecorder(size_t entries)
    : slots_(round_up_pow2(entries == 0 ? 1 : entries)), mask_(slots_.size() - 1), enabled_(entries > 0) {}

size_t FlightRecorder::configured_entries() {
  int64_t n = kEntries.integer();
  if (n < 0 || n > (1 << 24))
    throw InvalidArgument(fmt::format(
        "COHORT_FLIGHT_RECORDER_ENTRIES={} is out of range; use 0 (off) .. 16777216 (default 256)", kEntries.str()));
  return static_cast<size_t>(n);
}

int64_t FlightRecorder::configured_heartbeat_ms() {
  return kHeartbeat.millis().count();
}

int64_t FlightRecorder::now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void FlightRecorder::called(uint64_t seq, uint32_t fingerprint, uint64_t count, bool started_now) {
  if (!enabled_) return;
  Slot& s = slot(seq);
  const uint64_t v = s.version.load(kRelaxed);
  s.version.store(v + 1, kRelaxed);  // odd: being written
  std::atomic_thread_fence(std::memory_order_release);
  s.seq.store(seq, kRelaxed);
  s.fingerprint.store(fingerprint, kRelaxed);
  s.count.store(count, kRelaxed);
  const int64_t now = now_ns();
  s.state.store(static_cast<uint8_t>(started_now ? FlightState::Started : FlightState::Queued), kRelaxed);
  s.queued_ns.store(now, kRelaxed);
  s.start_ns.store(started_now ? now : 0, kRelaxed);
  s.end_ns.store(0, kRelaxed);
  s.version.store(v + 2, std::memory_order_release);
  called_.store(static_cast<int64_t>(seq), std::memory_order_release);
}

// started / finished change one entry's state and one time: single relaxed
// stores, no version bump (a reader may see the new state a moment before its
// time, which a diagnosis tolerates). Only called() rewrites a slot's identity
// and needs the seqlock.
void FlightRecorder::started(uint64_t seq) {
  if (!enabled_) return;
  Slot& s = slot(seq);
  if (s.seq.load(kRelaxed) != seq) return;  // over 256 queued: a newer call took the slot
  if (s.state.load(kRelaxed) == static_cast<uint8_t>(FlightState::Started)) return;  // called(..., started_now)
  s.start_ns.store(now_ns(), kRelaxed);
  s.state.store(static_cast<uint8_t>(FlightState::Started), std::memory_order_release);
}

void FlightRecorder::finished(uint64_t seq, bool ok) {
  if (!enabled_) return;
  Slot& s = slot(seq);
  if (ok) completed_.store(static_cast<int64_t>(seq), std::memory_order_release);
  if (s.seq.load(kRelaxed) != seq) return;
  s.end_ns.store(now_ns(), kRelaxed);
  s.state.store(static_cast<uint8_t>(ok ? FlightState::Completed : FlightState::Failed), std::memory_order_release);
}

std::optional<FlightEntry> FlightRecorder::read(const Slot& s) const {
  for (int attempt = 0; attempt < 4; ++attempt) {
    const uint64_t v1 = s.version.load(std::memory_order_acquire);
    if (v1 == 0) return std::nullopt;  // never written
    if (v1 & 1) continue;
    FlightEntry e;
    e.seq = s.seq.load(kRelaxed);
    e.fingerprint = s.fingerprint.load(kRelaxed);
    e.count = s.count.load(kRelaxed);
    e.state = static_cast<FlightState>(s.state.load(kRelaxed));
    e.queued_ns = s.queued_ns.load(kRelaxed);
    e.start_ns = s.start_ns.load(kRelaxed);
    e.end_ns = s.end_ns.load(kRelaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (s.version.load(kRelaxed) == v1) return e;
  }
  return std::nullopt;  // a writer kept it busy: skip rather than wait
}

std::optional<FlightEntry> FlightRecorder::find(uint64_t seq) const {
  auto e = read(slots_[seq & mask_]);
  if (!e || e->seq != seq) return std::nullopt;
  return e;
}

std::vector<FlightEntry> FlightRecorder::snapshot() const {
  std::vector<FlightEntry> out;
  const int64_t last = called_.load(std::memory_order_acquire);
  if (last < 0) return out;
  const uint64_t n = slots_.size();
  const uint64_t first = static_cast<uint64_t>(last) + 1 > n ? static_cast<uint64_t>(last) + 1 - n : 0;
  for (uint64_t seq = first; seq <= static_cast<uint64_t>(last); ++seq)
    if (auto e = find(seq)) out.push_back(*e);
  return out;
}

Progress FlightRecorder::progress() const {
  Progress p;
  // completed_ first: an operation is called before it completes, so called >= completed.
  p.completed = completed_.load(std::memory_order_acquire);
  p.called = called_.load(std::memory_order_acquire);
  if (p.called >= 0)
    if (auto e = find(static_cast<uint64_t>(p.called))) {
      p.called_fp = e->fingerprint;
      p.called_count = e->count;
      const int64_t age_ms = (now_ns() - e->queued_ns) / 1000000;
      const int64_t wall_now =
          std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
              .count();
      p.called_wall_ms = wall_now - age_ms;
    }
  if (p.completed >= 0)
    if (auto e = find(static_cast<uint64_t>(p.completed))) {
      p.completed_fp = e->fingerprint;
      p.completed_count = e->count;
    }
  return p;
}

}  // namespace cohort::group
