// Step metrics: /proc/net/dev parsing, a DDP iteration's times (pure), and
// StepMetrics over a 2-rank reducer (ranks as threads): the JSON lines of
// COHORT_METRICS parse and compute + exposed communication + data wait = step,
// and injected delays of known length land in the right column. And
// StopSignal: a caught SIGTERM, agreed by both ranks, its refusals, and the
// handler it replaced put back.
#include "cohort/metrics.hpp"
#include "cohort/stop_signal.hpp"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/net_dev.hpp"
#include "ddp/iteration_record.hpp"
#include "ddp_test_util.hpp"

namespace {

using namespace cohort;
using nlohmann::json;
using std::chrono::microseconds;

TEST(NetDev, ParsesReceivedAndTransmittedBytes) {
  const std::string text =
      "Inter-|   Receive                                                |  Transmit\n"
      " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier "
      "compressed\n"
      "    lo:  123456     100    0    0    0     0          0         0   123456     100    0    0    0     0       0 "
      "         0\n"
      "  eth0: 99 1 0 0 0 0 0 0 7777 2 0 0 0 0 0 0\n"
      "broken: 1 2 3\n";
  auto m = core::parse_net_dev(text);
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m["lo"].rx_bytes, 123456u);
  EXPECT_EQ(m["eth0"].rx_bytes, 99u);
  EXPECT_EQ(m["eth0"].tx_bytes, 7777u);
  EXPECT_TRUE(core::read_net_dev().count("lo")) << "every network namespace has lo";
}

TEST(IterationTimes, ExposedIsCommunicationAfterBackwardAndCommIsTheUnionInFlight) {
  const ddp::SteadyTime t0{std::chrono::seconds(1000)};
  ddp::IterationStats st;
  st.first_mark = t0;
  st.wait_started = t0 + microseconds(1000);
  // bucket 0 in flight 200..700 us (hidden), bucket 1 600..1300 (queued behind it, 300 us exposed), bucket 2 empty
  st.buckets = {{.index = 0, .bytes = 4000, .launched = t0 + microseconds(200), .completed = t0 + microseconds(700)},
                {.index = 1, .bytes = 6000, .launched = t0 + microseconds(600), .completed = t0 + microseconds(1300)},
                {.index = 2, .bytes = 0, .launched = t0 + microseconds(900), .completed = t0 + microseconds(900)}};
  auto it = ddp::iteration_times(st, 4);
  EXPECT_EQ(it.exposed_ns, 300'000);
  EXPECT_EQ(it.comm_ns, 1'100'000);
  EXPECT_EQ(it.bytes, 10000u);
  EXPECT_EQ(it.nranks, 4);

  ddp::IterationStats hidden = st;
  hidden.wait_started = t0 + microseconds(2000);  // backward outlasted every bucket
  EXPECT_EQ(ddp::iteration_times(hidden, 4).exposed_ns, 0);
}

// Two ranks (threads) step a reducer over the mixed model `steps` times under
// StepMetrics, sleeping data_ms where a loader would run and compute_ms where
// forward and backward would; each rank's summary, by rank.
std::map<int, StepSummary> run_steps(int steps, double data_ms, double compute_ms) {
  std::map<int, StepSummary> got;
  std::mutex mu;
  cohort::testing::run_ranks(2, "shm", [&](ProcessGroup& pg) {
    auto params = ddp::test::mixed_model();
    std::vector<std::vector<uint64_t>> grads;
    for (auto& p : params) {
      grads.emplace_back((p.count * dtype_size(p.dtype) + 7) / 8 + 1, 0);
      p.grad = grads.back().data();
    }
    ddp::Reducer reducer(pg, params, ddp::test::small_buckets());
    StepMetrics metrics(pg);
    for (int s = 0; s < steps; ++s) {
      metrics.begin_step();
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(data_ms));
      metrics.data_ready();
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(compute_ms));
      for (size_t p = params.size(); p-- > 0;) reducer.mark_ready(p, nullptr);
      reducer.finalize();
      metrics.end_step();
    }
    metrics.finish();
    std::lock_guard<std::mutex> lk(mu);
    got[pg.rank()] = metrics.summary();
  });
  return got;
}

TEST(StepMetrics, JsonLinesParseAndTheBreakdownAddsUp) {
  const std::string file =
      std::filesystem::temp_directory_path() / ("cohort_metrics_" + std::to_string(getpid()) + ".jsonl");
  std::filesystem::remove(file);
  ::setenv("COHORT_METRICS", file.c_str(), 1);
  ::setenv("COHORT_METRICS_EVERY", "2", 1);
  constexpr int kSteps = 4;
  const std::map<int, StepSummary> got = run_steps(kSteps, 1, 0);  // 1 ms "loading data"
  ::unsetenv("COHORT_METRICS");
  ::unsetenv("COHORT_METRICS_EVERY");

  ASSERT_EQ(got.size(), 2u);
  for (const auto& [rank, s] : got) {
    EXPECT_EQ(s.steps, kSteps);
    EXPECT_NEAR(s.compute_ms + s.exposed_comm_ms + s.data_wait_ms, s.step_ms, 1e-9 + 1e-9 * s.step_ms);
    EXPECT_GT(s.data_wait_ms, 0.0);
    EXPECT_GT(s.grad_bytes, 80000.0) << "the mixed model has an 80 KB parameter";
    EXPECT_DOUBLE_EQ(s.coll_sent_bytes, s.grad_bytes * kSteps);  // 2 ranks: 2 (n-1)/n = 1
  }
  std::ifstream in(file);
  std::string line;
  int windows = 0, summaries = 0;
  while (std::getline(in, line)) {
    json j = json::parse(line);
    if (j["kind"] == "window") {
      ++windows;
      EXPECT_EQ(j["steps"], 2);
    } else {
      ASSERT_EQ(j["kind"], "summary");
      ++summaries;
      const double sum =
          j["compute_ms"].get<double>() + j["exposed_comm_ms"].get<double>() + j["data_wait_ms"].get<double>();
      EXPECT_NEAR(sum, j["step_ms"].get<double>(), 1e-6) << line;
      EXPECT_EQ(j["steps"], kSteps);
    }
  }
  EXPECT_EQ(windows, 2 * kSteps / 2);
  EXPECT_EQ(summaries, 2);
  std::filesystem::remove(file);
}

// The breakdown adds up by construction (compute is the step less the rest),
// so that alone proves nothing: inject known delays, a data load and a
// backward pass that take at least 20 and 30 ms, and each must land in its
// own column. Only lower bounds (a sleep lasts at least its time), never
// upper ones: nothing here depends on how fast the machine is.
TEST(StepMetrics, KnownDelaysLandInTheirColumns) {
  constexpr double kDataMs = 20, kComputeMs = 30;
  const std::map<int, StepSummary> got = run_steps(3, kDataMs, kComputeMs);
  ASSERT_EQ(got.size(), 2u);
  for (const auto& [rank, s] : got) {
    EXPECT_GE(s.data_wait_ms, kDataMs) << "rank " << rank << ": the loader's time is data wait";
    EXPECT_GE(s.compute_ms, kComputeMs) << "rank " << rank << ": the backward pass is compute, not data wait";
    EXPECT_GE(s.step_ms, kDataMs + kComputeMs) << "rank " << rank;
  }
}

TEST(StepMetrics, MisuseIsNamed) {
  cohort::testing::run_ranks(1, "shm", [&](ProcessGroup& pg) {
    StepMetrics m(pg);
    EXPECT_THROW(m.end_step(), InvalidArgument);
    EXPECT_THROW(m.data_ready(), InvalidArgument);
  });
}

std::atomic<int> g_before{0};
extern "C" void before_handler(int sig) { g_before = sig; }

TEST(StopSignal, ASigtermIsAgreedByEveryRankAndTheOldHandlerComesBack) {
  struct sigaction mine {}, old {};
  mine.sa_handler = before_handler;
  sigemptyset(&mine.sa_mask);
  ASSERT_EQ(sigaction(SIGUSR1, &mine, &old), 0);
  {
    StopSignal stop({SIGTERM, SIGUSR1});
    EXPECT_EQ(stop.received(), 0);
    // Ranks are threads here, so both see the one flag: what is tested is
    // that agreed() is a collective both ranks return the same value from.
    cohort::testing::run_ranks(2, "shm", [&](ProcessGroup& pg) { EXPECT_EQ(stop.agreed(pg), 0); });
    raise(SIGUSR1);  // delivered before raise returns (one thread sends it to itself)
    raise(SIGTERM);  // the first signal is the one kept
    EXPECT_EQ(stop.received(), SIGUSR1);
    cohort::testing::run_ranks(2, "shm", [&](ProcessGroup& pg) { EXPECT_EQ(stop.agreed(pg), SIGUSR1); });
    EXPECT_EQ(g_before.load(), 0) << "the earlier handler ran while StopSignal was alive";
    try {
      StopSignal second;
      ADD_FAILURE() << "a second StopSignal was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("another StopSignal is alive"), std::string::npos) << e.what();
    }
  }
  raise(SIGUSR1);
  EXPECT_EQ(g_before.load(), SIGUSR1) << "the handler StopSignal replaced was not put back";
  sigaction(SIGUSR1, &old, nullptr);
}

// In a child process: a plain SIGTERM only sets the flag (the child goes on
// and exits 0), and the SIGTERM `cohort run` queues after a worker's failure
// ends the child as SIGTERM's default action would.
TEST(StopSignal, TheLaunchersStopAfterAFailureEndsTheProcessAtOnce) {
  for (const bool after_failure : {false, true}) {
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      StopSignal stop;
      if (after_failure)
        sigqueue(getpid(), SIGTERM, sigval{.sival_int = kStopAfterFailure});
      else
        kill(getpid(), SIGTERM);
      _exit(stop.received() == SIGTERM ? 0 : 3);
    }
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    if (after_failure) {
      EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << "status " << status;
    } else {
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
    }
  }
}

TEST(StopSignal, SignalsThatCannotAskForAStopAreRefusedByName) {
  for (int sig : {SIGKILL, SIGSEGV}) {
    try {
      StopSignal stop({sig});
      ADD_FAILURE() << "signal " << sig << " was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("signal " + std::to_string(sig) + " ("), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("HINT: use SIGTERM"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(StopSignal(std::vector<int>{}), InvalidArgument);
  EXPECT_THROW(StopSignal({SIGTERM, SIGUSR1, SIGTERM}), InvalidArgument);
  StopSignal fine;  // the refusals left nothing installed that blocks a new one
  EXPECT_EQ(fine.received(), 0);
}

}  // namespace
