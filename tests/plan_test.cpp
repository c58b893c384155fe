// The cost model and planner (src/plan/, docs/planning.md): the algorithm
// shapes, the least-squares fit, the calibration file and its errors, the
// composed node-aware prediction, the planner's formulas against the
// published figures they come from, and `cohort bench --calibrate` / `cohort
// plan` as a user runs them.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <filesystem>
#include <fstream>

#include "cohort/error.hpp"
#include "launch_harness.hpp"
#include "plan/calibration.hpp"
#include "plan/collective_time.hpp"
#include "plan/planner.hpp"

namespace cohort::plan {
namespace {

namespace lt = launch_test;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(PlanShapes, ClosedForms) {
  Shape s = algo_shape(Coll::Allreduce, Algo::Ring, 1 << 20, 4);
  EXPECT_DOUBLE_EQ(s.steps, 6);
  EXPECT_DOUBLE_EQ(s.bytes, 1.5 * (1 << 20));
  s = algo_shape(Coll::Allgather, Algo::Ring, 1 << 20, 4);
  EXPECT_DOUBLE_EQ(s.steps, 3);
  EXPECT_DOUBLE_EQ(s.bytes, 0.75 * (1 << 20));
  // 6 ranks: 2 fold into the largest power of two (4), 2 steps among 4, and back.
  s = algo_shape(Coll::Allreduce, Algo::RecursiveDoubling, 100, 6);
  EXPECT_DOUBLE_EQ(s.steps, 4);
  EXPECT_DOUBLE_EQ(s.bytes, 400);
  // Chain of 4 ranks, 4 segments of 256 KiB: nseg + n - 2 steps of one segment.
  s = algo_shape(Coll::Broadcast, Algo::Pipeline, 1 << 20, 4, 256 * 1024);
  EXPECT_DOUBLE_EQ(s.steps, 6);
  EXPECT_DOUBLE_EQ(s.bytes, 6 * 256 * 1024);
  s = algo_shape(Coll::Broadcast, Algo::Binomial, 1000, 5);
  EXPECT_DOUBLE_EQ(s.steps, 3);
  EXPECT_EQ(algo_shape(Coll::Allreduce, Algo::Ring, 1000, 1).steps, 0);
  EXPECT_THROW(algo_shape(Coll::Allreduce, Algo::Hierarchical, 1000, 4), InvalidArgument);
}

TEST(PlanShapes, BandsAndContention) {
  EXPECT_EQ(size_band(8), 0);
  EXPECT_EQ(size_band(16 * 1024), 0);
  EXPECT_EQ(size_band(64 * 1024), 1);
  EXPECT_EQ(size_band(1 << 20), 2);
  EXPECT_EQ(size_band(64 << 20), 3);
  const AlgoCost a{2, 5, 1e-3, 0, 0};
  const Shape s{3, 1000};
  EXPECT_DOUBLE_EQ(cost_us(a, s, Contention{2, 2}), 3 * 2 + 1000 * 1e-3);
  // 8 ranks on 2 cores: 6 wait for a core each step, and the copies share the cores 4 ways.
  EXPECT_DOUBLE_EQ(cost_us(a, s, Contention{8, 2}), 3 * (2 + 5 * 6) + 1000 * 1e-3 * 4);
}

std::vector<Sample> synthetic(const AlgoCost& truth, int cores, Coll c, Algo a, double lo, double hi) {
  std::vector<Sample> out;
  for (int n : {2, 4, 8})
    for (double b = lo; b <= hi; b *= 4) {
      const double us = cost_us(truth, algo_shape(c, a, b, n), Contention{n, cores});
      out.push_back(Sample{c, a, n, n, b, us});
    }
  return out;
}

TEST(PlanFit, RecoversTheCoefficientsThatMadeTheSamples) {
  const AlgoCost truth{1.5, 7, 2e-4, 0, 0};
  const AlgoCost fit = fit_algo(synthetic(truth, 2, Coll::Allreduce, Algo::Ring, 64, 64 << 20), 2, 256 * 1024);
  EXPECT_NEAR(fit.alpha_us, truth.alpha_us, 1e-6 * truth.alpha_us + 1e-9);
  EXPECT_NEAR(fit.alpha_os_us, truth.alpha_os_us, 1e-6 * truth.alpha_os_us);
  EXPECT_NEAR(fit.beta_us_per_byte, truth.beta_us_per_byte, 1e-6 * truth.beta_us_per_byte);
  EXPECT_LT(fit.max_rel_err, 1e-9);
  EXPECT_EQ(fit.points, 33);  // 11 sizes at 3 group sizes
}

TEST(PlanFit, CoefficientsStayNonNegative) {
  // Times that fall with size (noise): an unconstrained fit would give beta < 0.
  std::vector<Sample> s = {{Coll::Allreduce, Algo::Ring, 2, 2, 1000, 10}, {Coll::Allreduce, Algo::Ring, 2, 2, 4000, 9},
                           {Coll::Allreduce, Algo::Ring, 2, 2, 16000, 8.5}};
  const AlgoCost fit = fit_algo(s, 2, 256 * 1024);
  EXPECT_GE(fit.alpha_us, 0);
  EXPECT_GE(fit.alpha_os_us, 0);
  EXPECT_GE(fit.beta_us_per_byte, 0);
  EXPECT_GT(fit.alpha_us, 3);  // the level of the samples, in alpha
}

// A band the calibration reached with one size (its largest, -e 1M): the
// time is bytes there, so twice the size takes twice the time, not the same
// (alpha alone gave that band an infinite bandwidth); a small size is steps.
TEST(PlanFit, OneSizeIsBytesWhenLargeAndStepsWhenSmall) {
  const AlgoCost large = fit_algo({{Coll::Allreduce, Algo::Ring, 2, 2, 1 << 20, 144}}, 2, 256 * 1024);
  EXPECT_EQ(large.alpha_us, 0);
  EXPECT_GT(large.beta_us_per_byte, 0);
  const AlgoCost small = fit_algo({{Coll::Allreduce, Algo::Ring, 2, 2, 1024, 3}}, 2, 256 * 1024);
  EXPECT_GT(small.alpha_us, 0);
  EXPECT_EQ(small.beta_us_per_byte, 0);
  // Oversubscribed (8 ranks on 2 cores), and sizes a multiple of n apart: still bytes.
  const AlgoCost crowded = fit_algo({{Coll::Allgather, Algo::Ring, 4, 4, 1 << 20, 300},
                                     {Coll::Allgather, Algo::Ring, 7, 7, (1 << 20) - 28, 700}},
                                    2, 256 * 1024);
  EXPECT_EQ(crowded.alpha_us, 0);
  EXPECT_EQ(crowded.alpha_os_us, 0);
  EXPECT_GT(crowded.beta_us_per_byte, 0);
}

Calibration small_calibration(const char* version) {
  Calibration cal;
  cal.cohort_version = version;
  ClassSamples cs;
  cs.cores = 2;
  cs.measured = "test";
  const AlgoCost truth{1, 0, 1e-4, 0, 0};
  for (Coll c : {Coll::Allreduce, Coll::ReduceScatter, Coll::Allgather})
    for (auto& s : synthetic(truth, 2, c, Algo::Ring, 1024, 64 << 20))
      if (s.n == 2) cs.samples.push_back(s);
  cal.classes[LinkClass::Shm] = cs;
  return cal;
}

TEST(PlanCalibration, RoundTripAndMerge) {
  const std::string dir = lt::temp_dir();
  const std::string path = dir + "/cal.json";
  Calibration cal = small_calibration("9.9.9");
  write_calibration(path, cal);
  Calibration back = read_calibration(path, "9.9.9");
  ASSERT_EQ(back.classes.count(LinkClass::Shm), 1u);
  EXPECT_EQ(back.classes[LinkClass::Shm].samples.size(), cal.classes[LinkClass::Shm].samples.size());
  EXPECT_EQ(back.classes[LinkClass::Shm].cores, 2);
  // Merging a fresh run at 2 ranks replaces the 2-rank samples; one at 4 ranks adds.
  ClassSamples fresh;
  fresh.cores = 2;
  fresh.samples = {{Coll::Allreduce, Algo::Ring, 2, 2, 1024, 3}};
  merge_samples(back, LinkClass::Shm, fresh);
  EXPECT_EQ(back.classes[LinkClass::Shm].samples.size(), 1u);
  fresh.samples = {{Coll::Allreduce, Algo::Ring, 4, 4, 1024, 9}};
  merge_samples(back, LinkClass::Shm, fresh);
  EXPECT_EQ(back.classes[LinkClass::Shm].samples.size(), 2u);
  std::filesystem::remove_all(dir);
}

TEST(PlanCalibration, BadFilesSayWhatIsWrongAndWhatToRun) {
  const std::string dir = lt::temp_dir();
  const std::string path = dir + "/cal.json";
  std::string e = error_of([&] { read_calibration(dir + "/missing.json", "0.1.0"); });
  EXPECT_TRUE(contains(e, "cannot read it")) << e;
  EXPECT_TRUE(contains(e, "cohort bench --calibrate")) << e;
  write_calibration(path, small_calibration("0.0.7"));
  e = error_of([&] { read_calibration(path, "0.1.0"); });
  EXPECT_TRUE(contains(e, "measured by cohort 0.0.7, and this is cohort 0.1.0")) << e;
  EXPECT_TRUE(contains(e, "calibrate again")) << e;
  std::ofstream(path) << "{\"format\": \"something-else\"}";
  e = error_of([&] { read_calibration(path, "0.1.0"); });
  EXPECT_TRUE(contains(e, "is not a cohort calibration file")) << e;
  std::ofstream(path) << "{\"format\": \"cohort-calibration\", \"format_version\": 1, \"cohort_version\": \"0.1.0\", \"cla";
  e = error_of([&] { read_calibration(path, "0.1.0"); });
  EXPECT_TRUE(contains(e, "is damaged")) << e;
  std::ofstream(path) << "{\"format\": \"cohort-calibration\", \"format_version\": 7}";
  e = error_of([&] { read_calibration(path, "0.1.0"); });
  EXPECT_TRUE(contains(e, "format version 7")) << e;
  // Values no measurement gives (an edited file): refused, not silently fitted or dropped.
  const std::string head = "{\"format\": \"cohort-calibration\", \"format_version\": 1, \"cohort_version\": \"0.1.0\", "
                           "\"classes\": {\"shm\": {";
  for (const char* bad : {"\"cores\": 2, \"samples\": [[\"allreduce\", \"ring\", 2, 2, -1024, 3.0]]",
                          "\"cores\": 2, \"samples\": [[\"allreduce\", \"ring\", 2, 2, 1024, -3.0]]",
                          "\"cores\": 2, \"samples\": [[\"allreduce\", \"ring\", 2, 4, 1024, 3.0]]",
                          "\"cores\": 0, \"samples\": [[\"allreduce\", \"ring\", 2, 2, 1024, 3.0]]"}) {
    std::ofstream(path) << head << bad << "}}}";
    e = error_of([&] { read_calibration(path, "0.1.0"); });
    EXPECT_TRUE(contains(e, "edited or damaged")) << bad << ": " << e;
  }
  std::filesystem::remove_all(dir);
}

CostTable datasheet(double alpha_shm, double beta_shm, double alpha_tcp, double beta_tcp) {
  CostTable t;
  t.source = "test table";
  t.classes[LinkClass::Shm].fits["*"] = AlgoCost{alpha_shm, 0, beta_shm, 0, 0};
  t.classes[LinkClass::Shm].cores = 64;
  t.classes[LinkClass::TcpCross].fits["*"] = AlgoCost{alpha_tcp, 0, beta_tcp, 0, 0};
  t.classes[LinkClass::TcpCross].cores = 64;
  return t;
}

TEST(PlanPredict, FlatRingOnOneHost) {
  const CostTable t = datasheet(1, 1e-4, 50, 1e-3);
  GroupShape g;
  g.ranks_per_host = 4;
  const double S = 8 << 20;
  const Prediction p = predict_collective(t, Coll::Allgather, S, g);
  EXPECT_EQ(p.algo, Algo::Ring);
  EXPECT_DOUBLE_EQ(p.us, 3 * 1 + 0.75 * S * 1e-4);
}

TEST(PlanPredict, NodeAwareAllreduceIsTheSumOfItsPhases) {
  const CostTable t = datasheet(1, 1e-4, 50, 1e-3);
  GroupShape g;
  g.hosts = 2;
  g.ranks_per_host = 2;
  const double S = 64 << 20;
  const Prediction p = predict_collective(t, Coll::Allreduce, S, g);
  EXPECT_EQ(p.algo, Algo::Hierarchical);
  // Reduce-scatter on the host (1 step, S/2), allreduce of S/2 across 2 hosts (ring: 2 steps, S/2), allgather on the host.
  const double want = (1 + 0.5 * S * 1e-4) + (2 * 50 + 0.5 * S * 1e-3) + (1 + 0.5 * S * 1e-4);
  EXPECT_NEAR(p.us, want, 1e-9 * want);
  EXPECT_TRUE(contains(p.how, "hierarchical")) << p.how;
}

TEST(PlanPredict, RecursiveDoublingCrossesHostsOnlyInItsLastSteps) {
  const CostTable t = datasheet(1, 1e-4, 50, 1e-3);
  GroupShape g;
  g.hosts = 2;
  g.ranks_per_host = 4;
  const Prediction p = predict_collective(t, Coll::Allreduce, 1024, g);
  EXPECT_EQ(p.algo, Algo::RecursiveDoubling);
  // 2 steps among the 4 ranks of a host, 1 across the 2 hosts.
  EXPECT_NEAR(p.us, 2 * (1 + 1024 * 1e-4) + (50 + 1024 * 1e-3), 1e-9);
}

TEST(PlanPredict, TheLinkLimitsWhatCrossesIt) {
  const CostTable t = datasheet(1, 1e-6, 20, 1e-6);  // calibrated fast
  GroupShape g;
  g.hosts = 2;
  g.ranks_per_host = 1;
  g.cross_gbps = 1;  // but the wire is 1 Gbit/s
  const double S = 64 << 20;
  const Prediction p = predict_collective(t, Coll::Allreduce, S, g);
  EXPECT_NEAR(p.us, 2 * 20 + S / (125e6 * 1448 / 1538) * 1e6, 1);  // ring of 2: S each way per rank, TCP payload
}

TEST(PlanPredict, MissingClassOrAlgorithmIsNamed) {
  CostTable t = datasheet(1, 1e-4, 50, 1e-3);
  t.classes.erase(LinkClass::TcpCross);
  GroupShape g;
  g.hosts = 2;
  g.ranks_per_host = 2;
  std::string e = error_of([&] { predict_collective(t, Coll::Allreduce, 1 << 20, g); });
  EXPECT_TRUE(contains(e, "has no link class 'tcp_cross' (it has: shm)")) << e;
  EXPECT_TRUE(contains(e, "one rank per host")) << e;
  CostTable only_ring;
  only_ring.source = "f";
  only_ring.classes[LinkClass::Shm].fits[band_key("allreduce/ring", 3)] = AlgoCost{1, 0, 1e-4, 3, 0};
  GroupShape one;
  one.ranks_per_host = 4;
  e = error_of([&] { predict_collective(only_ring, Coll::Allreduce, 8, one); });
  EXPECT_TRUE(contains(e, "no measurements of allreduce/recursive_doubling")) << e;
}

TEST(PlanPredict, OrdinaryBuffersRunTheRingWhereSharedOnesWouldSingleCopy) {
  // An allgather of 512 KiB in all (256 KiB a rank): single copy on shared buffers only.
  collectives::TunerInput in{Coll::Allgather, 256 << 10, 2, true, true, 1, 0};
  EXPECT_EQ(collectives::choose(in), Algo::SingleCopy);
  EXPECT_EQ(algorithm_run(in, collectives::Thresholds{}), Algo::Ring);
  // From allreduce_single_copy_min (1 MiB) in all, on any buffers.
  in.bytes = 512 << 10;
  EXPECT_EQ(algorithm_run(in, collectives::Thresholds{}), Algo::SingleCopy);
  in.coll = Coll::Allreduce;
  in.bytes = 4 << 20;
  EXPECT_EQ(algorithm_run(in, collectives::Thresholds{}), Algo::SingleCopy);
  in.coll = Coll::ReduceScatter;  // only on shared buffers, at any size
  EXPECT_EQ(algorithm_run(in, collectives::Thresholds{}), Algo::Ring);
}

// Megatron-LM SC21 (Narayanan et al. 2021), Table 1: parameters from eq. 2 for its configurations.
TEST(PlanPredict, AMeasuredGroupIsReadFromItsOwnSamples) {
  // 2 ranks copy fast, 8 ranks on the same 2 cores queue: no one set of coefficients holds both.
  Calibration cal;
  cal.cohort_version = "t";
  ClassSamples& cs = cal.classes[LinkClass::Shm];
  cs.cores = 2;
  for (double b : {1.0 * (1 << 20), 4.0 * (1 << 20), 16.0 * (1 << 20)}) {
    cs.samples.push_back({Coll::Allgather, Algo::Ring, 2, 2, b, 1 + b * 1e-4});
    cs.samples.push_back({Coll::Allgather, Algo::Ring, 8, 8, b, 200 + b * 3e-3});
    cal.classes[LinkClass::TcpCross].samples.push_back({Coll::Allgather, Algo::Ring, 2, 2, b, 30 + b * 1e-3});
  }
  cal.classes[LinkClass::TcpCross].cores = 2;
  const CostTable t = cost_table(cal, "test");
  GroupShape g;
  g.ranks_per_host = 2;
  // Between two measured sizes: the alpha-beta line through them; past the last, the fit.
  Prediction p = predict_collective(t, Coll::Allgather, 2 << 20, g);
  EXPECT_NEAR(p.us, 1 + (2 << 20) * 1e-4, 1e-6);
  EXPECT_TRUE(contains(p.how, "(measured group)")) << p.how;
  EXPECT_NEAR(predict_collective(t, Coll::Allgather, 16 << 20, g).us, 1 + (16 << 20) * 1e-4, 1e-6);
  EXPECT_FALSE(contains(predict_collective(t, Coll::Allgather, 64 << 20, g).how, "(measured group)"));
  g.ranks_per_host = 8;
  EXPECT_NEAR(predict_collective(t, Coll::Allgather, 8 << 20, g).us, 200 + (8 << 20) * 3e-3, 1e-6);
  // A group size never measured takes the fit over all of them.
  g.ranks_per_host = 4;
  p = predict_collective(t, Coll::Allgather, 8 << 20, g);
  EXPECT_FALSE(contains(p.how, "(measured group)")) << p.how;
  const ClassCosts& costs = t.classes.at(LinkClass::Shm);
  const AlgoCost* fit = costs.find("allgather/ring", 8 << 20);
  ASSERT_NE(fit, nullptr);
  EXPECT_NEAR(p.us, cost_us(*fit, algo_shape(Coll::Allgather, Algo::Ring, 8 << 20, 4), Contention{4, 2}), 1e-6);
  // Ranks of one host among several (a phase of the node-aware algorithms, here on namespaces of one
  // machine where all 4 ranks share the cores) are not the group that was measured.
  g.hosts = 2;
  g.ranks_per_host = 2;
  g.same_machine = true;
  p = predict_collective(t, Coll::Allgather, 8 << 20, g);
  EXPECT_EQ(p.algo, Algo::Hierarchical);
  EXPECT_FALSE(contains(p.how, "(measured group)")) << p.how;
  // Two namespaces of one rank each are the tcp_cross group that was measured.
  g.ranks_per_host = 1;
  p = predict_collective(t, Coll::Allgather, 2 << 20, g);
  EXPECT_NEAR(p.us, 30 + (2 << 20) * 1e-3, 1e-6);
}

TEST(Planner, TransformerParametersMatchMegatronTable1) {
  struct Row {
    const char* preset;
    double billions;
  };
  for (Row r : {Row{"gpt:1.7b", 1.7}, Row{"gpt:3.6b", 3.6}, Row{"gpt:7.5b", 7.5}, Row{"gpt:18.4b", 18.4},
                Row{"gpt:39.1b", 39.1}, Row{"gpt:145.6b", 145.6}}) {
    ModelFlags f;
    f.preset = r.preset;
    const ModelSpec m = model_spec(f);
    EXPECT_DOUBLE_EQ(std::round(m.params / 1e8) / 10, r.billions) << r.preset << ": " << m.params;  // as printed
  }
}

// The cost table `cohort plan --cluster` builds from a cluster's datasheet.
CostTable datasheet_table(const ClusterFlags& cf) {
  CostTable t;
  t.source = "test";
  apply_datasheet(t, cluster_spec(cf));
  return t;
}

// ZeRO (Rajbhandari et al. 2020), Figure 1: 7.5B parameters, mixed-precision Adam (K = 12), 64 devices:
// 120 GB per device replicated, 31.4 with P_os, 16.6 with P_os+g, 1.9 with P_os+g+p.
TEST(Planner, ZeroMemoryMatchesThePaper) {
  ModelFlags f;
  f.spec.params = 7.5e9;
  f.spec.global_batch = 64;
  f.spec.activation_bytes_per_sample = 1e-9;  // states only
  ClusterSpec c;
  c.hosts = 8;
  c.devices_per_host = 8;
  c.gpu = true;
  c.device_memory_gb = 1000;
  c.device_tflops = 100;
  c.intra_gbs = 300;
  c.inter_gbps = 1600;
  ClusterFlags cf;
  cf.spec = c;
  const CostTable t = datasheet_table(cf);
  const PlanResult r = plan_layouts(model_spec(f), cluster_spec(cf), t);
  std::map<int, double> gb;
  for (const Layout& L : r.layouts) gb[L.zero] = L.memory_gb;
  EXPECT_NEAR(gb[0], 120, 0.1);
  EXPECT_NEAR(gb[1], 31.4, 0.1);
  EXPECT_NEAR(gb[2], 16.6, 0.1);
  EXPECT_NEAR(gb[3] - 7.5e9 * 4 / 1e9, 1.9, 0.1);  // + the model's weights and grads gathered as one unit
}

TEST(Planner, PipelineBubbleIsPMinusOneOverM) {
  ModelFlags f;
  f.preset = "gpt:39.1b";
  ClusterFlags cf;
  cf.preset = "a100-80g";
  cf.spec.hosts = 64;
  const CostTable t = datasheet_table(cf);
  const PlanResult r = plan_layouts(model_spec(f), cluster_spec(cf), t);
  bool seen = false;
  for (const Layout& L : r.layouts) {
    if (L.tp != 8 || L.pp != 2 || L.zero != 0 || L.chunks != 1 || L.sp) continue;
    seen = true;
    EXPECT_EQ(L.dp, 32);
    EXPECT_EQ(L.micro_batches, 1536 / 32);
    EXPECT_NEAR(L.bubble_ms / L.compute_ms, 1.0 / 48, 1e-12);  // (p - 1) / m
  }
  EXPECT_TRUE(seen);
}

// The interleaved schedule with v chunks per stage (Narayanan et al. 2021, section 2.2.2): the bubble is
// (p-1)/(v m), the stage boundaries are crossed v times as often, and the first stage holds
// L (1 + (p-1)/(pv)) layers' activations instead of L (Korthikanti et al. 2022).
TEST(Planner, InterleavingDividesTheBubbleByTheChunks) {
  ModelFlags f;
  f.preset = "gpt:39.1b";  // 48 layers, h 8192, s 2048, with recomputation: 2 s b h bytes per layer
  ClusterFlags cf;
  cf.preset = "a100-80g";
  cf.spec.hosts = 64;
  const CostTable t = datasheet_table(cf);
  const ModelSpec m = model_spec(f);
  std::map<int, Layout> by_chunks;
  for (const Layout& L : plan_layouts(m, cluster_spec(cf), t).layouts)
    if (L.tp == 8 && L.pp == 2 && L.zero == 0 && !L.sp) by_chunks[L.chunks] = L;
  ASSERT_EQ(by_chunks.size(), 3u);  // 1, 2 and 4 chunks: 48 layers divide by 2, 4 and 8
  const Layout &one = by_chunks[1], &two = by_chunks[2], &four = by_chunks[4];
  EXPECT_NEAR(two.bubble_ms / one.bubble_ms, 0.5, 1e-12);
  EXPECT_NEAR(four.bubble_ms / one.bubble_ms, 0.25, 1e-12);
  EXPECT_GT(two.pp_ms, one.pp_ms);
  const double layer_bytes = 2.0 * m.seq * one.micro_batch * m.hidden;
  EXPECT_NEAR((two.memory_gb - one.memory_gb) * kGB, 0.25 * layer_bytes * m.layers, 1e-6 * layer_bytes);  // (p-1)/(pv) = 1/4
  EXPECT_NEAR((four.memory_gb - one.memory_gb) * kGB, 0.125 * layer_bytes * m.layers, 1e-6 * layer_bytes);
  // With as many micro-batches as stages (batch 64 over dp 32: m = 2 = p) the schedules start all of them
  // before the first backward: 1F1B holds 2 micro-batches of L/2 layers, 2 chunks 4 of L/4, the same.
  f.spec.global_batch = 64;
  std::map<int, double> gb;
  for (const Layout& L : plan_layouts(model_spec(f), cluster_spec(cf), t).layouts)
    if (L.tp == 8 && L.pp == 2 && L.zero == 0 && !L.sp) gb[L.chunks] = L.memory_gb;
  ASSERT_EQ(gb.count(2), 1u);
  EXPECT_NEAR(gb[2], gb[1], 1e-12);
}

// Sequence parallelism (Korthikanti et al. 2022, Table 2): the activations between the tensor-parallel
// regions are split t ways, and each allreduce becomes an allgather and a reduce-scatter of the same bytes.
TEST(Planner, SequenceParallelismSplitsActivationsNotTraffic) {
  ModelFlags f;
  f.preset = "gpt:18.4b";
  f.recompute = 0;
  ClusterFlags cf;
  cf.preset = "a100-80g";
  cf.spec.hosts = 32;
  const CostTable t = datasheet_table(cf);
  const ModelSpec m = model_spec(f);
  std::map<bool, Layout> by_sp;
  for (const Layout& L : plan_layouts(m, cluster_spec(cf), t).layouts)
    if (L.tp == 8 && L.pp == 1 && L.zero == 1) by_sp[L.sp] = L;
  ASSERT_EQ(by_sp.size(), 2u);
  const double s = m.seq, b = by_sp[false].micro_batch, h = m.hidden, tp = 8;
  // Per layer s b h (10 + 24/t) against s b h (34/t); the attention term 5as/(ht) is the same.
  const double saved = s * b * h * (10 + 24 / tp - 34 / tp) * m.layers;
  EXPECT_NEAR((by_sp[false].memory_gb - by_sp[true].memory_gb) * kGB, saved, 1e-6 * saved);
  EXPECT_NEAR(by_sp[true].tp_ms / by_sp[false].tp_ms, 1, 1e-9);  // rings: the same steps and bytes
  EXPECT_GT(by_sp[true].tp_ms, 0);
  // Only where tp divides the sequence: 2050 tokens split 2 ways, not 4 or 8.
  f.spec.seq = 2050;
  std::set<int> sp_tp;
  for (const Layout& L : plan_layouts(model_spec(f), cluster_spec(cf), t).layouts)
    if (L.sp) sp_tp.insert(L.tp);
  EXPECT_EQ(sp_tp, std::set<int>{2});
}

// The optimizer step streams the states of the parameters a device updates once: 28 bytes per parameter
// for Adam, 20 for SGD with momentum, at the device's memory bandwidth; ZeRO divides it by dp.
TEST(Planner, OptimizerStepIsMemoryBoundAndShardedByZero) {
  ClusterFlags cf;
  cf.preset = "a100-80g";
  cf.spec.hosts = 2;
  const CostTable t = datasheet_table(cf);
  ModelFlags f;
  f.preset = "gpt:1.7b";
  const ModelSpec m = model_spec(f);
  std::map<int, double> opt_ms;
  for (const Layout& L : plan_layouts(m, cluster_spec(cf), t).layouts)
    if (L.tp == 1 && L.pp == 1) opt_ms[L.zero] = L.optimizer_ms;
  const double ddp = m.params * 28 / (2039 * kGB) * 1e3;
  EXPECT_NEAR(opt_ms[0], ddp, 1e-9 * ddp);
  for (int z : {1, 2, 3}) EXPECT_NEAR(opt_ms[z], ddp / 16, 1e-9 * ddp) << "ZeRO-" << z;
  f.precision = "fp32";
  f.optimizer = "sgd";
  for (const Layout& L : plan_layouts(model_spec(f), cluster_spec(cf), t).layouts)
    if (L.tp == 1 && L.pp == 1 && L.zero == 0) {
      EXPECT_NEAR(L.optimizer_ms, m.params * 20 / (2039 * kGB) * 1e3, 1e-6);
    }
  cf.spec.memory_gbs = 1000;  // a flag overrides the preset
  for (const Layout& L : plan_layouts(m, cluster_spec(cf), t).layouts)
    if (L.tp == 1 && L.pp == 1 && L.zero == 0) {
      EXPECT_NEAR(L.optimizer_ms, m.params * 28 / (1000 * kGB) * 1e3, 1e-6);
    }
  // A step measured per sample (--sample-ms) holds its optimizer already.
  ModelFlags measured = f;
  measured.spec.sample_ms = 10;
  const PlanResult mr = plan_layouts(model_spec(measured), cluster_spec(cf), t);
  for (const Layout& L : mr.layouts) EXPECT_EQ(L.optimizer_ms, 0) << L.name();
  EXPECT_TRUE(contains(format_plan(model_spec(measured), cluster_spec(cf), mr, 1, false), "the optimizer step is in --sample-ms"));
  // Without a bandwidth the step is not modelled, and the plan says so.
  ClusterFlags cpu;
  cpu.spec.devices_per_host = 2;
  cpu.spec.device_memory_gb = 4;
  cpu.spec.device_tflops = 1;
  ModelFlags mlp;
  mlp.preset = "mlp";
  const CostTable shm = datasheet(1, 1e-4, 50, 1e-3);
  const PlanResult r = plan_layouts(model_spec(mlp), cluster_spec(cpu), shm);
  for (const Layout& L : r.layouts) EXPECT_EQ(L.optimizer_ms, 0);
  const std::string out = format_plan(model_spec(mlp), cluster_spec(cpu), r, 3, false);
  EXPECT_TRUE(contains(out, "the optimizer step is not modelled: give --memory-gbs")) << out;
}

TEST(Planner, NothingFitsSaysWhatTheSmallestLayoutNeeds) {
  ModelFlags f;
  f.preset = "gpt:145.6b";
  ClusterFlags cf;
  cf.preset = "a100-80g";
  cf.spec.hosts = 1;
  const CostTable t = datasheet_table(cf);
  const std::string e = error_of([&] { plan_layouts(model_spec(f), cluster_spec(cf), t); });
  EXPECT_TRUE(contains(e, "fits no layout on 1 host(s) x 8 device(s) of 85.9 GB")) << e;  // 80 GiB
  EXPECT_TRUE(contains(e, "needs")) << e;
  EXPECT_TRUE(contains(e, "Add hosts")) << e;
}

// ZeRO-2 keeps a gradient shard and FSDP reshards after each pass: with gradient accumulation they
// communicate per micro-batch, DDP and ZeRO-1 once per step.
TEST(Planner, ShardedStagesCommunicatePerMicroBatch) {
  ClusterFlags cf;
  cf.preset = "a100-80g";
  cf.spec.hosts = 2;
  const CostTable t = datasheet_table(cf);
  std::map<int, std::map<int, double>> dp_ms;  // micro-batch -> zero stage -> data-parallel ms
  for (int mb : {4, 1}) {
    ModelFlags f;
    f.preset = "gpt:1.7b";
    f.spec.global_batch = 64;
    f.spec.micro_batch = mb;  // 64 / 16 ranks = 4 samples each: 1 or 4 micro-batches
    for (const Layout& L : plan_layouts(model_spec(f), cluster_spec(cf), t).layouts)
      if (L.tp == 1 && L.pp == 1) dp_ms[mb][L.zero] = L.dp_ms;
  }
  EXPECT_NEAR(dp_ms[1][0] / dp_ms[4][0], 1, 1e-12);
  EXPECT_NEAR(dp_ms[1][1] / dp_ms[4][1], 1, 1e-12);
  EXPECT_GT(dp_ms[1][2] / dp_ms[4][2], 2);
  EXPECT_NEAR(dp_ms[1][3] / dp_ms[4][3], 4, 1e-9);
}

TEST(Planner, FlagsOverrideThePreset) {
  ModelFlags f;
  f.preset = "mlp";
  EXPECT_EQ(model_spec(f).precision, "fp32");
  f.precision = "bf16";
  f.optimizer = "adam";
  EXPECT_EQ(model_spec(f).precision, "bf16");
  EXPECT_EQ(model_spec(f).optimizer, "adam");
  ModelFlags g;
  g.preset = "gpt:1.7b";
  EXPECT_TRUE(model_spec(g).recompute);
  g.recompute = 0;
  EXPECT_FALSE(model_spec(g).recompute);
  ClusterFlags cf;
  cf.preset = "a100-80g";
  EXPECT_EQ(resolve_cluster(cf).devices_per_host, 8);
  cf.spec.devices_per_host = 1;  // asked for: kept
  EXPECT_EQ(resolve_cluster(cf).devices_per_host, 1);
}

TEST(Planner, BadModelAndClusterInput) {
  ModelFlags f;
  std::string e = error_of([&] { model_spec(f); });
  EXPECT_TRUE(contains(e, "give a preset")) << e;
  f.preset = "gpt:9000b";
  e = error_of([&] { model_spec(f); });
  EXPECT_TRUE(contains(e, "unknown preset")) << e;
  f.preset = "";
  f.spec.layers = 4;
  e = error_of([&] { model_spec(f); });
  EXPECT_TRUE(contains(e, "needs --hidden")) << e;
  ClusterFlags cf;
  e = error_of([&] { cluster_spec(cf); });
  EXPECT_TRUE(contains(e, "--device-memory-gb")) << e;
  cf.preset = "tpu-v9";
  e = error_of([&] { cluster_spec(cf); });
  EXPECT_TRUE(contains(e, "unknown preset")) << e;
}

// As a user: calibrate shared memory at 2 ranks, then ask for predictions.
TEST(PlanCli, CalibrateThenPlan) {
  const std::string dir = lt::temp_dir();
  const std::string cal = dir + "/cal.json";
  auto r = lt::run({"run", "--standalone", "--nproc-per-node", "2", COHORT_BIN, "bench", "--calibrate", cal, "-e", "1M"},
                   {}, 300);
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "calibrated shm")) << r.out;
  r = lt::run({"plan", "--calibration", cal, "--collective", "allreduce", "--ranks-per-host", "2", "--sizes", "8,64K,1M",
               "--csv"});
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  int rows = 0;
  std::istringstream lines(r.out);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind("allreduce,1,2,", 0) != 0) continue;
    ++rows;
    const double us = std::stod(line.substr(line.find(',', 14) + 1));
    EXPECT_GT(us, 0) << line;
  }
  EXPECT_EQ(rows, 3) << r.out;
  // Across hosts it needs the tcp_cross class, which this file lacks.
  r = lt::run({"plan", "--calibration", cal, "--collective", "allreduce", "--hosts", "2", "--ranks-per-host", "2"});
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(contains(r.err, "no link class 'tcp_cross'")) << r.err;
  // ... unless the link's speed is given.
  r = lt::run({"plan", "--calibration", cal, "--collective", "allreduce", "--hosts", "2", "--ranks-per-host", "2",
               "--inter-host-gbps", "10", "--sizes", "64M"});
  EXPECT_EQ(r.status, 0) << r.err;
  // No collective and no --calibrate is refused.
  r = lt::run({"run", "--standalone", "--nproc-per-node", "1", COHORT_BIN, "bench"});
  EXPECT_NE(r.status, 0);
  // A file from another cohort.
  std::string text;
  {
    std::ifstream in(cal);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  const auto at = text.find("\"cohort_version\"");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, text.find(',', at) - at, "\"cohort_version\": \"0.0.1\"");
  std::ofstream(cal) << text;
  r = lt::run({"plan", "--calibration", cal, "--collective", "allreduce", "--ranks-per-host", "2"});
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(contains(r.err, "measured by cohort 0.0.1")) << r.err;
  std::filesystem::remove_all(dir);
}

TEST(PlanCli, CalibrationLeavesAFileItCannotReadAlone) {
  const std::string dir = lt::temp_dir();
  const std::string cal = dir + "/cal.json";
  std::ofstream(cal) << "not json";
  auto r = lt::run({"run", "--standalone", "--nproc-per-node", "2", COHORT_BIN, "bench", "--calibrate", cal, "-e", "64K"},
                   {}, 120);
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(contains(r.out + r.err, "is damaged")) << r.out << r.err;
  std::ifstream in(cal);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(text, "not json");
  std::filesystem::remove_all(dir);
}

TEST(PlanCli, ClusterPresetAndBadNumbers) {
  auto r = lt::run({"plan", "--collective", "allreduce", "--cluster", "a100-80g", "--hosts", "2", "--sizes", "1M"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "2 host(s) x 8 rank(s)")) << r.out;
  EXPECT_TRUE(contains(r.out, "nccl_cross")) << r.out;
  r = lt::run({"plan", "--model", "gpt:7.5b", "--cluster", "a100-80g", "--hosts", "0"});
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(contains(r.err, "--hosts")) << r.err;
  r = lt::run({"plan", "--model", "mlp", "--global-batch", "-4", "--device-memory-gb", "8", "--sample-ms", "1"});
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(contains(r.err, "--global-batch")) << r.err;
  r = lt::run({"plan", "--model", "mlp", "--device-memory-gb", "8"});  // no compute rate
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(contains(r.err, "--sample-ms")) << r.err;
  // NaN passed CLI11's checks; a huge --gpus-per-host wrapped the divisor loop into SIGFPE.
  r = lt::run({"plan", "--model", "gpt:7.5b", "--cluster", "a100-80g", "--hosts", "1", "--mfu", "nan"});
  EXPECT_EQ(r.status != 0 && contains(r.err, "--mfu: expected a number in (0, 1], got nan"), true) << r.err;
  r = lt::run({"plan", "--model", "gpt:1.7b", "--cluster", "a100-80g", "--hosts", "1", "--gpus-per-host", "2147483647"});
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_TRUE(contains(r.err, "at most 4096 per host")) << r.err;
  // A flag the chosen mode would ignore is named, with the way out.
  r = lt::run({"plan", "--collective", "allreduce", "--ranks-per-host", "2", "--model", "gpt:1.7b"});
  EXPECT_EQ(r.status != 0 && contains(r.err, "--model describes the model") && contains(r.err, "HINT"), true) << r.err;
  r = lt::run({"plan", "--collective", "allreduce", "--ranks-per-host", "2", "--top", "3"});
  EXPECT_EQ(r.status != 0 && contains(r.err, "--top"), true) << r.err;
  r = lt::run({"plan", "--model", "gpt:1.7b", "--cluster", "a100-80g", "--hosts", "1", "--sizes", "1M"});
  EXPECT_EQ(r.status != 0 && contains(r.err, "--sizes is for --collective"), true) << r.err;
  r = lt::run({"plan", "--model", "gpt:1.7b", "--cluster", "a100-80g", "--hosts", "1", "--transport", "tcp"});
  EXPECT_EQ(r.status != 0 && contains(r.err, "--transport is for --collective"), true) << r.err;
  // A first word that is no command is named.
  r = lt::run({"bogus"});
  EXPECT_EQ(r.status, 1);
  EXPECT_TRUE(contains(r.err, "'bogus' is not a cohort command")) << r.err;
}

TEST(PlanCli, ModelThatFitsNowhere) {
  auto r = lt::run({"plan", "--model", "gpt:145.6b", "--cluster", "a100-80g", "--hosts", "1"});
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(contains(r.err, "fits no layout")) << r.err;
  r = lt::run({"plan", "--model", "gpt:7.5b", "--cluster", "a100-80g", "--hosts", "16", "--top", "3"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "TFLOP/s")) << r.out;
}

}  // namespace
}  // namespace cohort::plan
