// COHORT_TIMELINE end to end: 2-rank jobs under `cohort run`
// (tests/progs/coll_worker.cpp) write one Chrome trace per rank; `cohort trace
// merge` joins them with aligned clocks; `cohort trace summary` reads the
// breakdown and draws it. Plus the pure parts (clock offset estimate, SVG).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "cohort/error.hpp"
#include "core/clock_sync.hpp"
#include "launch_harness.hpp"

namespace lt = launch_test;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// 3 allreduces of 1 MiB (queued: larger than COHORT_INLINE_BYTES; ring) on 2 ranks.
lt::Result job(const std::string& dir, std::map<std::string, std::string> env = {}) {
  env["COHORT_TIMELINE"] = dir;
  for (const char* k : {"COHORT_DEBUG", "COHORT_TRANSPORT", "COHORT_ALGO", "COHORT_INLINE_BYTES"}) env.emplace(k, "");
  env.emplace("COHORT_SINGLE_COPY_BYTES", "0");  // the ring, whatever the kernel allows
  env.emplace("COHORT_TIMELINE_CLOCK", "");
  return lt::run(
      {"run", "--standalone", "--nproc-per-node", "2", lt::prog("coll_worker"), "allreduce-loop", "1048576", "3"},
      std::move(env), 120);
}

std::vector<json> spans(const json& events, int pid, const std::string& cat) {
  std::vector<json> out;
  for (const auto& e : events)
    if (e.value("ph", "") == "X" && e.value("pid", -1) == pid && e.value("cat", "") == cat) out.push_back(e);
  return out;
}

json clock_of(const json& events) {
  for (const auto& e : events)
    if (e.value("name", "") == "cohort_clock") return e["args"];
  return json();
}

// Every "<tag" is closed by "/>" or a matching "</tag>", in order: the SVG is well-formed XML as far as tags go.
bool tags_balanced(const std::string& s) {
  std::vector<std::string> stack;
  for (size_t i = s.find('<'); i != std::string::npos; i = s.find('<', i + 1)) {
    size_t end = s.find('>', i);
    if (end == std::string::npos) return false;
    std::string tag = s.substr(i + 1, end - i - 1);
    if (tag.empty()) return false;
    if (tag[0] == '/') {
      if (stack.empty() || stack.back() != tag.substr(1)) return false;
      stack.pop_back();
    } else if (tag.back() != '/') {
      stack.push_back(tag.substr(0, tag.find(' ')));
    }
  }
  return stack.empty();
}

}  // namespace

TEST(Timeline, EachRankWritesValidJsonWithItsCollectives) {
  const std::string dir = lt::temp_dir();
  auto r = job(dir);
  ASSERT_EQ(r.status, 0) << r.err;
  for (int rank : {0, 1}) {
    const std::string path = dir + "/rank" + std::to_string(rank) + ".json";
    json events = json::parse(slurp(path), nullptr, false);  // strict: the file must be complete JSON
    ASSERT_FALSE(events.is_discarded()) << path << ":\n" << slurp(path);
    ASSERT_TRUE(events.is_array());
    auto colls = spans(events, rank, "coll");
    ASSERT_EQ(colls.size(), 3u) << events.dump(1);
    for (size_t i = 0; i < colls.size(); ++i) {
      const json& a = colls[i]["args"];
      EXPECT_EQ(colls[i]["name"], "allreduce");
      EXPECT_EQ(a["op"], "allreduce");
      EXPECT_EQ(a["seq"], i);
      EXPECT_EQ(a["bytes"], 1048576);
      EXPECT_EQ(a["algo"], "ring");
      EXPECT_EQ(a["group"], "0");
      EXPECT_EQ(a["dtype"], "f32");
      EXPECT_EQ(a["queued"], true);
      EXPECT_GE(colls[i]["dur"].get<double>(), 0.0);
    }
    int queue_begins = 0;
    for (const auto& e : events) queue_begins += e.value("ph", "") == "b" && e.value("cat", "") == "queue";
    EXPECT_EQ(queue_begins, 3) << "each queued allreduce has a 'queued' span";
    json clk = clock_of(events);
    EXPECT_EQ(clk["rank"], rank);
    EXPECT_EQ(clk["offset_ns"], 0) << "ranks on rank 0's host share its clock";
  }
}

TEST(Timeline, MergeJoinsRanksWithAlignedClocksAndSummaryReadsIt) {
  const std::string dir = lt::temp_dir();
  auto r = job(dir);
  ASSERT_EQ(r.status, 0) << r.err;
  const std::string out = dir + "/job.json";
  auto m = lt::run({"trace", "merge", dir, "-o", out}, {}, 60);
  ASSERT_EQ(m.status, 0) << m.err;
  EXPECT_TRUE(contains(m.out, "from 2 rank(s)")) << m.out;
  json j = json::parse(slurp(out));
  const json& ev = j["traceEvents"];
  std::set<int> pids;
  for (const auto& e : ev) {
    if (e["ph"] != "M") {
      EXPECT_GE(e["ts"].get<double>(), 0.0) << "the merged job starts at 0";
    }
    pids.insert(e["pid"].get<int>());
  }
  EXPECT_EQ(pids, (std::set<int>{0, 1}));
  EXPECT_EQ(j["otherData"]["cohort"]["ranks"].size(), 2u);
  // A ring allreduce cannot end on one rank before it started on the other (each needs the other's data):
  // on aligned clocks, the two ranks' spans of each sequence number overlap.
  auto a = spans(ev, 0, "coll"), b = spans(ev, 1, "coll");
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    double a0 = a[i]["ts"], a1 = a0 + a[i]["dur"].get<double>(), b0 = b[i]["ts"], b1 = b0 + b[i]["dur"].get<double>();
    EXPECT_LT(a0, b1) << "seq " << i;
    EXPECT_LT(b0, a1) << "seq " << i;
  }

  const std::string svg = dir + "/breakdown.svg";
  auto s = lt::run({"trace", "summary", out, "--svg", svg}, {}, 60);
  ASSERT_EQ(s.status, 0) << s.err;
  EXPECT_TRUE(contains(s.out, "exposed comm")) << s.out;
  for (int rank : {0, 1}) {
    size_t at = s.out.find("rank " + std::to_string(rank) + " allreduce ");
    ASSERT_NE(at, std::string::npos) << s.out;
    EXPECT_TRUE(contains(s.out.substr(at, s.out.find('\n', at) - at), " 3 calls")) << s.out;
  }
  EXPECT_TRUE(contains(s.out, "the whole trace counts as one step")) << s.out;
  const std::string text = slurp(svg);
  EXPECT_EQ(text.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u) << text;
  EXPECT_TRUE(tags_balanced(text)) << text;
  EXPECT_TRUE(contains(text, ">rank 1</text>")) << text;
}

TEST(Timeline, PingedClockOffsetIsWithinItsErrorBound) {
  const std::string dir = lt::temp_dir();
  auto r = job(dir, {{"COHORT_TIMELINE_CLOCK", "ping"}});
  ASSERT_EQ(r.status, 0) << r.err;
  json clk = clock_of(json::parse(slurp(dir + "/rank1.json")));
  EXPECT_TRUE(contains(clk["method"].get<std::string>(), "ping through the store")) << clk.dump();
  // Same host, same clock: the true offset is 0, and the estimate is off by at most half the best round trip.
  EXPECT_LE(std::llabs(clk["offset_ns"].get<int64_t>()), clk["error_ns"].get<int64_t>() + 1) << clk.dump();
}

TEST(Timeline, MergeRepairsAFileCutShortAndNamesAnEmptyDirectory) {
  const std::string dir = lt::temp_dir();
  {
    std::ofstream f(dir + "/rank0.json");
    f << "[\n{\"ph\":\"M\",\"pid\":0,\"tid\":0,\"name\":\"cohort_clock\",\"args\":{\"rank\":0,\"offset_ns\":0}},\n"
         "{\"ph\":\"X\",\"pid\":0,\"tid\":1,\"ts\":10.5,\"dur\":2,\"name\":\"allreduce\",\"cat\":\"coll\"},\n"
         "{\"ph\":\"X\",\"pid\":0,\"tid\":1,\"ts\":20,\"du";  // the process died mid-line
  }
  auto m = lt::run({"trace", "merge", dir, "-o", dir + "/job.json"}, {}, 60);
  ASSERT_EQ(m.status, 0) << m.err;
  EXPECT_TRUE(contains(m.err, "note: rank0.json was cut short")) << m.err;
  json j = json::parse(slurp(dir + "/job.json"));
  EXPECT_EQ(spans(j["traceEvents"], 0, "coll").size(), 1u) << j.dump();

  const std::string empty = lt::temp_dir();
  auto e = lt::run({"trace", "merge", empty, "-o", empty + "/job.json"}, {}, 60);
  EXPECT_NE(e.status, 0);
  EXPECT_TRUE(contains(e.err, "holds no rank<R>.json files; HINT: run the job with COHORT_TIMELINE=")) << e.err;
}

TEST(Timeline, OffWritesNothing) {
  const std::string dir = lt::temp_dir();
  auto r =
      lt::run({"run", "--standalone", "--nproc-per-node", "2", lt::prog("coll_worker"), "allreduce-loop", "1000", "2"},
              {{"COHORT_TIMELINE", ""}}, 120);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(fs::is_empty(dir));
}

TEST(ClockSync, TheShortestRoundTripWins) {
  // Local clock 1000 ns behind rank 0's. The slow round trip (asymmetric) would mislead; the fast one does not.
  std::vector<cohort::core::PingSample> s{{0, 1000 + 900, 1000}, {5000, 5000 + 1000 + 50, 5100}};
  auto off = cohort::core::estimate_offset(s);
  EXPECT_EQ(off.offset_ns, 1000);
  EXPECT_EQ(off.error_ns, 50);
  EXPECT_THROW(cohort::core::estimate_offset({}), cohort::InvalidArgument);
}

TEST(Pictures, BenchPlotDrawsOurCurveAndThePeers) {
  const std::string dir = lt::temp_dir();
  {
    std::ofstream f(dir + "/peers.csv");
    f << "name,size_bytes,busbw_gbps\nmpi shm (median),1024,0.5\nmpi shm (median),65536,2.5\n";
  }
  auto r = lt::run({"run", "--standalone", "--nproc-per-node", "2", COHORT_BIN, "bench", "allreduce", "--sizes",
                    "1K,64K", "-n", "3", "-w", "1", "--plot", dir + "/bw.svg", "--plot-peers", dir + "/peers.csv"},
                   {{"COHORT_TIMELINE", ""}}, 120);
  ASSERT_EQ(r.status, 0) << r.err;
  const std::string svg = slurp(dir + "/bw.svg");
  EXPECT_TRUE(tags_balanced(svg)) << svg;
  EXPECT_TRUE(contains(svg, ">cohort native</text>")) << svg;
  EXPECT_TRUE(contains(svg, ">mpi shm (median)</text>")) << svg;
  EXPECT_TRUE(contains(svg, ">64K</text>")) << "a size tick on the log2 axis:\n" << svg;
  int polylines = 0;
  for (size_t at = svg.find("<polyline"); at != std::string::npos; at = svg.find("<polyline", at + 1)) ++polylines;
  EXPECT_EQ(polylines, 3) << "out-of-place, in-place and the peer";

  {
    std::ofstream f(dir + "/bad.csv");
    f << "mpi,1024,fast\n";
  }
  auto bad =
      lt::run({"bench", "allreduce", "--sizes", "1K", "--plot", dir + "/x.svg", "--plot-peers", dir + "/bad.csv"},
              {{"COHORT_TIMELINE", ""},
               {"RANK", "0"},
               {"WORLD_SIZE", "1"},
               {"MASTER_ADDR", "127.0.0.1"},
               {"MASTER_PORT", std::to_string(lt::free_port_pair())}},
              60);
  EXPECT_NE(bad.status, 0);
  EXPECT_TRUE(contains(bad.err, "line 1: 'mpi,1024,fast' is not 'name,size_bytes,busbw_gbps'")) << bad.err;
}

TEST(Timeline, SummaryArithmeticOnAHandMadeTrace) {
  // Two ranks, two steps each, in microseconds. Rank 0: steps of 100, data 10, comm wait 20 (bucket in flight 50).
  // Rank 1: steps of 100, data 10, no wait, and 29% more compute than rank 0 (90 vs 70): the hint names it.
  json ev = json::array();
  auto x = [&](int pid, const char* name, const char* cat, double ts, double dur) {
    ev.push_back({{"ph", "X"}, {"pid", pid}, {"tid", 1}, {"ts", ts}, {"dur", dur}, {"name", name}, {"cat", cat}});
  };
  for (int step = 0; step < 2; ++step) {
    const double t = step * 100;
    x(0, "step", "step", t, 100);
    x(0, "data", "step", t, 10);
    x(0, "comm wait", "ddp", t + 70, 20);
    ev.push_back({{"ph", "b"},
                  {"pid", 0},
                  {"ts", t + 40},
                  {"id", std::to_string(step)},
                  {"name", "bucket 0 allreduce"},
                  {"cat", "bucket"}});
    ev.push_back({{"ph", "e"},
                  {"pid", 0},
                  {"ts", t + 90},
                  {"id", std::to_string(step)},
                  {"name", "bucket 0 allreduce"},
                  {"cat", "bucket"}});
    x(1, "step", "step", t, 100);
    x(1, "data", "step", t, 10);
  }
  const std::string dir = lt::temp_dir();
  {
    std::ofstream f(dir + "/job.json");
    f << json{{"traceEvents", ev}}.dump();
  }
  auto s = lt::run({"trace", "summary", dir + "/job.json"}, {}, 60);
  ASSERT_EQ(s.status, 0) << s.err;
  // per step: step 0.1 ms = compute 0.07 + exposed 0.02 + data 0.01; in flight 0.05 ms, 60% hidden
  EXPECT_TRUE(contains(s.out, "    0      2      0.100       0.070         0.020      0.010      0.050    60.0%"))
      << s.out;
  EXPECT_TRUE(contains(s.out, "    1      2      0.100       0.090         0.000      0.010      0.000     0.0%"))
      << s.out;
  EXPECT_TRUE(contains(s.out, "HINT: rank 1 computes 29% longer per step than rank 0")) << s.out;
}
