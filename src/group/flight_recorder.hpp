// FlightRecorder: each group's bounded, always-on record of its recent
// collectives, for hang diagnosis (docs/fault-tolerance.md).
//
// A ring of COHORT_FLIGHT_RECORDER_ENTRIES slots (default 256; rounded up to a
// power of two), indexed by the operation's sequence number modulo the ring size. Each slot holds what
// identifies the call on every rank (sequence number, the fingerprint of
// collective / dtype / op / root, element count) and its state with the times
// it was queued, started and ended.
//
// Writers: the thread that issues an operation (called) and the thread that
// runs it (started / finished). The group runs one operation at a time and
// hands it over under its mutex, so a slot never has two writers at once.
// Readers (the heartbeat, the hang verdict, tests) may run on any thread at
// any time: each slot's identity (seq, fingerprint, count) is written under a
// seqlock (odd version = being written), and every field is a relaxed atomic,
// so a reader sees a whole identity or skips the entry; state and times are
// single stores.
// No locks, no allocation after construction, no syscalls on the hot path: the
// times come from CLOCK_MONOTONIC_COARSE (a vDSO read; a few ms resolution).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace cohort::group {

enum class FlightState : uint8_t { Queued = 0, Started = 1, Completed = 2, Failed = 3 };
const char* flight_state_name(FlightState s);

// One operation as a reader sees it. Times are CLOCK_MONOTONIC_COARSE in ns (0: not yet).
struct FlightEntry {
  uint64_t seq = 0;
  uint32_t fingerprint = 0;  // OpDesc::fingerprint(): collective, dtype, op, root
  uint64_t count = 0;        // OpDesc::call_count()
  FlightState state = FlightState::Queued;
  int64_t queued_ns = 0, start_ns = 0, end_ns = 0;

  // "allreduce #5 (f32 x 1024, sum)"
  std::string describe() const;
};

// What a rank publishes to the store as its heartbeat: the last operation it
// called and the last one it completed (seq -1: none yet), and when it
// published that, so that a reader can say how old it is.
struct Progress {
  int64_t called = -1;
  uint32_t called_fp = 0;
  uint64_t called_count = 0;
  int64_t called_wall_ms = 0;  // wall-clock time of that call (ms since the epoch), to say how long it waited
  int64_t completed = -1;
  uint32_t completed_fp = 0;
  uint64_t completed_count = 0;
  int64_t published_wall_ms = 0;  // when it was written to the store (ms since the epoch; 0: unknown)

  bool operator==(const Progress&) const = default;
  std::string encode() const;  // one short text line
  static std::optional<Progress> decode(const std::string& s);
};

class FlightRecorder {
 public:
  // entries 0: disabled (every call returns at once; nothing is recorded).
  explicit FlightRecorder(size_t entries);
  // The ring size COHORT_FLIGHT_RECORDER_ENTRIES asks for (0: disabled).
  static size_t configured_entries();
  // COHORT_FLIGHT_RECORDER_HEARTBEAT in milliseconds (0: heartbeats off).
  static int64_t configured_heartbeat_ms();

  // Hot path: caller's / progress thread, one writer per slot at a time (see above).
  // started_now: the caller runs it at once (inline), so the call is also its
  // start; started() then costs one load.
  void called(uint64_t seq, uint32_t fingerprint, uint64_t count, bool started_now = false);
  void started(uint64_t seq);
  void finished(uint64_t seq, bool ok);

  // Any thread.
  Progress progress() const;
  std::optional<FlightEntry> find(uint64_t seq) const;  // nullopt: overwritten or never recorded
  std::vector<FlightEntry> snapshot() const;            // oldest first
  size_t capacity() const { return enabled_ ? slots_.size() : 0; }
  bool enabled() const { return enabled_; }

  static int64_t now_ns();  // the recorder's clock

 private:
  struct alignas(64) Slot {  // one cache line per operation
    std::atomic<uint64_t> version{0};
    std::atomic<uint64_t> seq{0};
    std::atomic<uint32_t> fingerprint{0};
    std::atomic<uint64_t> count{0};
    std::atomic<uint8_t> state{0};
    std::atomic<int64_t> queued_ns{0}, start_ns{0}, end_ns{0};
  };
  Slot& slot(uint64_t seq) { return slots_[seq & mask_]; }
  std::optional<FlightEntry> read(const Slot& s) const;

  std::vector<Slot> slots_;  // a power of two, so that a slot is seq & mask_ (no division on the hot path)
  uint64_t mask_ = 0;
  bool enabled_ = true;
  std::atomic<int64_t> called_{-1};
  std::atomic<int64_t> completed_{-1};
};

}  // namespace cohort::group
