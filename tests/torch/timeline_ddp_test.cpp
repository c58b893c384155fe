// A 2-rank DDP run of the Fashion-MNIST example with COHORT_TIMELINE and
// COHORT_METRICS: the trace has spans from both ranks (steps, phases, DDP
// backward, bucket allreduces, collectives), the bucket allreduces overlap
// backward, and the metrics lines parse and add up.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "launch_harness.hpp"

namespace {

namespace lt = launch_test;
namespace fs = std::filesystem;
using nlohmann::json;

constexpr int kSteps = 6;

bool have_data() {
  return fs::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz");
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class TimelineDdp : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!have_data()) return;
    dir_ = new std::string(lt::temp_dir());
    // Small buckets (16 KiB) so that the CNN's gradients travel in several buckets during backward.
    result_ = new lt::Result(lt::run(
        {"run", "--standalone", "--nproc-per-node", "2", COHORT_FASHION_MNIST_BIN, "--epochs", "1", "--max-steps",
         std::to_string(kSteps), "--bucket-cap-mb", "0.015625", "--first-bucket-mb", "0.015625", "--threads", "1"},
        {{"OMP_NUM_THREADS", "1"},
         {"COHORT_TIMELINE", *dir_ + "/tl"},
         {"COHORT_METRICS", *dir_ + "/metrics.jsonl"},
         {"COHORT_METRICS_EVERY", "3"},
         {"COHORT_DEBUG", ""}},
        600));
  }
  void SetUp() override {
    if (!have_data()) GTEST_SKIP() << "Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)";
    ASSERT_EQ(result_->status, 0) << result_->out << result_->err;
  }
  static json trace(int rank) { return json::parse(slurp(*dir_ + "/tl/rank" + std::to_string(rank) + ".json")); }

  static std::string* dir_;
  static lt::Result* result_;
};
std::string* TimelineDdp::dir_ = nullptr;
lt::Result* TimelineDdp::result_ = nullptr;

std::vector<json> events(const json& ev, const std::string& ph, const std::string& name_prefix) {
  std::vector<json> out;
  for (const auto& e : ev)
    if (e.value("ph", "") == ph && e.value("name", "").rfind(name_prefix, 0) == 0) out.push_back(e);
  return out;
}

TEST_F(TimelineDdp, BothRanksHaveStepsPhasesBucketsAndCollectives) {
  for (int rank : {0, 1}) {
    json ev = trace(rank);
    for (const auto& e : ev) ASSERT_EQ(e["pid"], rank) << e.dump();
    EXPECT_EQ(events(ev, "X", "step").size(), size_t(kSteps)) << "rank " << rank;
    EXPECT_EQ(events(ev, "X", "forward").size(), size_t(kSteps));
    EXPECT_EQ(events(ev, "X", "optimizer step").size(), size_t(kSteps));
    EXPECT_EQ(events(ev, "X", "data").size(), size_t(kSteps));
    EXPECT_EQ(events(ev, "X", "comm wait").size(), size_t(kSteps));
    // backward: the example's phase and DDP's own span (first gradient -> finalize waits)
    EXPECT_EQ(events(ev, "X", "backward").size(), size_t(2 * kSteps));
    auto ready = events(ev, "i", "bucket ");
    auto launched = events(ev, "b", "bucket ");
    EXPECT_GE(launched.size(), size_t(2 * kSteps)) << "several buckets per step";
    EXPECT_EQ(ready.size(), launched.size());
    bool has_allreduce = false;
    for (const auto& e : events(ev, "X", "allreduce")) has_allreduce |= e["args"]["bytes"].get<int64_t>() > 0;
    EXPECT_TRUE(has_allreduce);
  }
}

TEST_F(TimelineDdp, BucketAllreducesOverlapBackward) {
  for (int rank : {0, 1}) {
    json ev = trace(rank);
    std::map<int64_t, double> backward_end;  // iteration -> when DDP's backward ended (finalize began waiting)
    for (const auto& e : events(ev, "X", "backward"))
      if (e["cat"] == "ddp")
        backward_end[e["args"]["iteration"].get<int64_t>()] = e["ts"].get<double>() + e["dur"].get<double>();
    ASSERT_EQ(backward_end.size(), size_t(kSteps));
    // In every iteration, the first bucket's allreduce was launched while backward still ran
    // (its gradients were the first ready; the later layers' gradients were still being computed).
    int overlapping = 0;
    for (const auto& e : events(ev, "b", "bucket 0 allreduce")) {
      const int64_t it = e["args"]["iteration"];
      ASSERT_TRUE(backward_end.count(it)) << e.dump();
      EXPECT_FALSE(e["args"]["launched_in_finalize"].get<bool>());
      overlapping += e["ts"].get<double>() < backward_end[it];
    }
    EXPECT_EQ(overlapping, kSteps) << "rank " << rank;
  }
}

TEST_F(TimelineDdp, MergedTraceSummaryShowsTheBreakdown) {
  const std::string job = *dir_ + "/job.json", svg = *dir_ + "/steps.svg";
  auto m = lt::run({"trace", "merge", *dir_ + "/tl", "-o", job}, {}, 60);
  ASSERT_EQ(m.status, 0) << m.err;
  auto s = lt::run({"trace", "summary", job, "--svg", svg}, {}, 60);
  ASSERT_EQ(s.status, 0) << s.err;
  EXPECT_NE(s.out.find("    1      " + std::to_string(kSteps) + " "), std::string::npos) << s.out;
  EXPECT_EQ(s.out.find("the whole trace counts as one step"), std::string::npos) << s.out;
  EXPECT_NE(slurp(svg).find("exposed communication"), std::string::npos);
}

TEST_F(TimelineDdp, MetricsLinesParseAndAddUp) {
  std::ifstream in(*dir_ + "/metrics.jsonl");
  std::string line;
  std::map<int, json> summary;
  int windows = 0;
  while (std::getline(in, line)) {
    json j = json::parse(line);  // throws (fails the test) on a torn or bad line
    if (j["kind"] == "summary") {
      summary[j["rank"].get<int>()] = j;
    } else if (j["kind"] == "window") {
      ++windows;
      EXPECT_EQ(j["steps"], 3);
    }
  }
  EXPECT_EQ(windows, 2 * (kSteps / 3)) << "a line every 3 steps from each rank";
  ASSERT_EQ(summary.size(), 2u);
  for (auto& [rank, j] : summary) {
    EXPECT_EQ(j["steps"], kSteps);
    const double step = j["step_ms"], compute = j["compute_ms"], exposed = j["exposed_comm_ms"],
                 data = j["data_wait_ms"];
    EXPECT_GT(step, 0);
    EXPECT_NEAR(compute + exposed + data, step, 1e-6 * step) << j.dump();
    EXPECT_GE(j["overlap_pct"].get<double>(), 0);
    EXPECT_LE(j["overlap_pct"].get<double>(), 100);
    EXPECT_LE(exposed, j["comm_ms"].get<double>() + 1e-9) << "exposed communication is part of the communication";
    EXPECT_GT(j["grad_bytes"].get<double>(), 800e3) << "the CNN has 225 k f32 parameters";
    EXPECT_GT(j["busbw_gbps"].get<double>(), 0);
    EXPECT_DOUBLE_EQ(j["coll_sent_bytes"].get<double>(), j["grad_bytes"].get<double>() * kSteps);  // 2 (n-1)/n = 1
    EXPECT_TRUE(j["net"].is_object());
  }
  EXPECT_NE(result_->out.find("hidden behind backward"), std::string::npos) << result_->out;
}

}  // namespace
