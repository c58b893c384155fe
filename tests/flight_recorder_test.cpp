// The flight recorder's ring, the heartbeat encoding, the verdict sentence
// (a pure function) and the verdict of a real timeout between thread ranks.
#include "group/flight_recorder.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <thread>

#include "group/hang_verdict.hpp"
#include "group/op.hpp"
#include "test_util.hpp"

namespace cohort::group {
namespace {

uint32_t allreduce_f32_fp() {
  OpDesc d{collectives::Coll::Allreduce};
  d.send = d.recv = Buffer{nullptr, 1024, DType::F32};
  return d.fingerprint();
}

TEST(FlightRecorder, RecordsStatesInOrder) {
  FlightRecorder fr(4);
  EXPECT_TRUE(fr.snapshot().empty());
  EXPECT_EQ(fr.progress().called, -1);
  fr.called(0, allreduce_f32_fp(), 1024);
  fr.started(0);
  fr.finished(0, true);
  fr.called(1, allreduce_f32_fp(), 1024);
  fr.started(1);
  auto snap = fr.snapshot();
  ASSERT_EQ(snap.size(), 2u);
  EXPECT_EQ(snap[0].state, FlightState::Completed);
  EXPECT_GE(snap[0].end_ns, snap[0].start_ns);
  EXPECT_EQ(snap[1].state, FlightState::Started);
  EXPECT_EQ(snap[1].describe(), "allreduce #1 (f32 x 1024, sum)");
  Progress p = fr.progress();
  EXPECT_EQ(p.called, 1);
  EXPECT_EQ(p.completed, 0);
  EXPECT_EQ(p.completed_count, 1024u);
  fr.finished(1, false);
  EXPECT_EQ(fr.find(1)->state, FlightState::Failed);
  EXPECT_EQ(fr.progress().completed, 0) << "a failed operation is not completed";
}

TEST(FlightRecorder, RingKeepsTheNewestEntries) {
  FlightRecorder fr(3);  // rounded up to 4
  EXPECT_EQ(fr.capacity(), 4u);
  for (uint64_t s = 0; s < 10; ++s) {
    fr.called(s, allreduce_f32_fp(), s);
    fr.started(s);
    fr.finished(s, true);
  }
  auto snap = fr.snapshot();
  ASSERT_EQ(snap.size(), 4u);
  EXPECT_EQ(snap[0].seq, 6u);
  EXPECT_EQ(snap[3].seq, 9u);
  EXPECT_FALSE(fr.find(2).has_value()) << "overwritten";
}

TEST(FlightRecorder, ReadersRunBesideTheWriter) {
  FlightRecorder fr(8);
  std::atomic<bool> stop{false};
  std::thread reader([&] {
    while (!stop.load()) {
      for (const auto& e : fr.snapshot()) ASSERT_EQ(e.count, e.seq * 2) << "a torn entry";
      Progress p = fr.progress();
      ASSERT_LE(p.completed, p.called);
    }
  });
  for (uint64_t s = 0; s < 200000; ++s) {
    fr.called(s, allreduce_f32_fp(), s * 2);
    fr.started(s);
    fr.finished(s, true);
  }
  stop = true;
  reader.join();
}

TEST(FlightRecorder, MoreQueuedThanSlotsKeepsTheNewerCall) {
  FlightRecorder fr(4);
  for (uint64_t s = 0; s < 5; ++s) fr.called(s, allreduce_f32_fp(), s);  // #4 takes #0's slot
  fr.started(0);
  fr.finished(0, true);
  ASSERT_TRUE(fr.find(4).has_value());
  EXPECT_EQ(fr.find(4)->state, FlightState::Queued);
  EXPECT_EQ(fr.progress().completed, 0);
}

TEST(FlightRecorder, ZeroEntriesTurnsItOff) {
  FlightRecorder fr(0);
  EXPECT_FALSE(fr.enabled());
  fr.called(0, allreduce_f32_fp(), 1);
  fr.started(0);
  fr.finished(0, true);
  EXPECT_TRUE(fr.snapshot().empty());
  EXPECT_EQ(fr.progress().called, -1);
}

TEST(FlightRecorder, ProgressRoundTripsAndRejectsJunk) {
  Progress p{7, 123, 1024, 1700000000000, 6, 99, 512, 1700000001234};
  auto q = Progress::decode(p.encode());
  ASSERT_TRUE(q.has_value());
  EXPECT_EQ(*q, p);
  // A record from a cohort before v2 still reads; its age is unknown (0).
  auto old = Progress::decode("v1 7 123 1024 1700000000000 6 99 512");
  ASSERT_TRUE(old.has_value());
  EXPECT_EQ(old->completed, 6);
  EXPECT_EQ(old->published_wall_ms, 0);
  EXPECT_FALSE(Progress::decode("").has_value());
  EXPECT_FALSE(Progress::decode("v1 1 2 3").has_value());
  EXPECT_FALSE(Progress::decode(p.encode() + " tail").has_value());
  EXPECT_FALSE(Progress::decode("v2 1 2 3 4 5 6 7").has_value());
  EXPECT_FALSE(Progress::decode("v3 1 2 3 4 5 6 7 8").has_value());
}

HungCall call5() {
  HungCall c;
  c.group_id = std::string(1, '0');  // (not = "0": GCC 12 -Wrestrict false positive)
  c.seq = 5;
  c.fingerprint = allreduce_f32_fp();
  c.count = 1048576;
  c.waited_s = 2.0;
  return c;
}

Progress at(int64_t called, int64_t completed, int64_t wall = 0) {
  Progress p;
  p.called = called;
  p.called_fp = allreduce_f32_fp();
  p.called_count = 1048576;
  p.called_wall_ms = wall;
  p.completed = completed;
  p.completed_fp = allreduce_f32_fp();
  p.completed_count = 1048576;
  return p;
}

TEST(HangVerdict, NamesTheRankThatNeverEntered) {
  std::string v = form_hang_verdict(call5(), {at(5, 4), at(4, 4), at(5, 4)}, 0);
  EXPECT_EQ(v,
            "hang verdict: rank 1 never entered allreduce #5 (group 0, 1048576 elements, f32); ranks 0,2 have "
            "waited 2.0 s in it; rank 1's last completed operation was allreduce #4 (f32 x 1048576, sum)");
}

TEST(HangVerdict, SaysHowOldWhatItReportsIs) {
  Progress late = at(4, 4);
  late.published_wall_ms = 9000;
  std::string v = form_hang_verdict(call5(), {at(5, 4), late}, 12500);
  EXPECT_NE(v.find("rank 1's last completed operation was allreduce #4 (f32 x 1048576, sum) (as published 3.5 s ago)"),
            std::string::npos)
      << v;
  Progress fresh = at(-1, -1);
  fresh.published_wall_ms = 12000;
  v = form_hang_verdict(call5(), {at(5, 4), fresh}, 12500);
  EXPECT_NE(v.find("rank 1's last completed operation was none: it had completed no collective in this group when "
                   "it last published its progress, 0.5 s ago"),
            std::string::npos)
      << v;
}

TEST(HangVerdict, WaitedTimeComesFromTheOthersCallTimes) {
  std::string v = form_hang_verdict(call5(), {at(5, 4, 10000), at(4, 4), at(5, 4, 10500)}, 12000);
  EXPECT_NE(v.find("ranks 0,2 have waited 1.5 s in it"), std::string::npos) << v;
}

TEST(HangVerdict, DifferentCallsAtTheSameNumberAreADesync) {
  Progress other = at(5, 4);
  other.called_count = 512;
  std::string v = form_hang_verdict(call5(), {at(5, 4), other}, 0);
  EXPECT_NE(v.find("desync at #5 of group 0: rank 0 called allreduce #5 (f32 x 1048576, sum), rank 1 called "
                   "allreduce #5 (f32 x 512, sum)"),
            std::string::npos)
      << v;
}

TEST(HangVerdict, EveryoneInsideAndSilentAndBehind) {
  std::string all_in = form_hang_verdict(call5(), {at(5, 4), at(5, 4)}, 0);
  EXPECT_NE(all_in.find("every rank entered allreduce #5"), std::string::npos) << all_in;
  std::string silent = form_hang_verdict(call5(), {at(5, 4), std::nullopt}, 0);
  EXPECT_NE(silent.find("rank 1 published no progress"), std::string::npos) << silent;
  std::string behind = form_hang_verdict(call5(), {at(5, 4), at(6, 2)}, 0);
  EXPECT_NE(behind.find("rank 1 is stuck in an earlier operation: it has not completed #3"), std::string::npos)
      << behind;
  std::string first = form_hang_verdict(call5(), {at(5, 4), at(-1, -1)}, 0);
  EXPECT_NE(first.find("rank 1's last completed operation was none"), std::string::npos) << first;
}

// Thread ranks: rank 1 sleeps before allreduce #2; ranks 0 and 2 time out in it.
TEST(HangVerdict, TimeoutBetweenThreadRanks) {
  setenv("COHORT_FLIGHT_RECORDER_HEARTBEAT", "100ms", 1);
  std::vector<std::string> errs(3);
  cohort::testing::run_ranks(3, "shm", [&](ProcessGroup& pg) {
    std::vector<float> v(16, 1.0f);
    try {
      for (int it = 0; it < 3; ++it) {
        if (it == 2 && pg.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(3500));
        pg.allreduce(buffer(v), {.timeout = Millis(1500)})->wait();
      }
    } catch (const Error& e) {
      errs[pg.rank()] = e.what();
    }
  });
  unsetenv("COHORT_FLIGHT_RECORDER_HEARTBEAT");
  for (int r : {0, 2})
    EXPECT_NE(errs[r].find("hang verdict: rank 1 never entered allreduce #2 (group 0, 16 elements, f32)"),
              std::string::npos)
        << "rank " << r << ": " << errs[r];
  EXPECT_NE(errs[0].find("rank 1's last completed operation was allreduce #1 (f32 x 16, sum)"), std::string::npos)
      << errs[0];
}

}  // namespace
}  // namespace cohort::group
