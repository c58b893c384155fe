// examples/gpt under `cohort run`: tensor, sequence, pipeline (GPipe, 1F1B,
// interleaved) and data parallelism, alone and together (dp 2 x tp 2 x pp 2,
// 8 processes), give the losses and the parameters of one process on the same
// global batch (double precision, 20 steps, to 1e-5 relative); a checkpoint
// saved at one layout resumes exactly at others; weights per rank at tp 2 are half
// the model's; bad layouts fail at once, by name.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <regex>
#include <string>

#include <signal.h>

#include "cohort/checkpoint.hpp"
#include "launch_harness.hpp"
#include "test_deps.hpp"

namespace {

namespace lt = launch_test;
namespace fs = std::filesystem;

const std::map<std::string, std::string> kEnv{{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}};
const std::vector<std::string> kModel{"--layers", "4", "--dim", "64", "--heads", "4", "--context", "32",
                                      "--batch", "8", "--dtype", "f64", "--print-every", "1", "--warmup", "5"};

void need_text() {
  if (!fs::exists("/usr/share/games/fortunes/fortunes"))
    COHORT_MISSING_DEP("the fortunes text is not installed (apt-get install fortunes)");
}

struct Job {
  std::map<int, double> losses;  // by step
  std::string out;
  std::smatch result;
};

Job train(int nproc, std::vector<std::string> layout, const std::string& save, int steps,
          const std::string& load = "", const std::vector<std::string>& model = kModel) {
  std::vector<std::string> args{"run", "--standalone", "--nproc-per-node", std::to_string(nproc), COHORT_GPT_BIN};
  args.insert(args.end(), model.begin(), model.end());
  args.insert(args.end(), layout.begin(), layout.end());
  for (const std::string& a : {std::string("--max-steps"), std::to_string(steps), std::string("--save"), save})
    args.push_back(a);
  if (!load.empty()) args.insert(args.end(), {"--load", load});
  const auto r = lt::run(args, kEnv, 600);
  Job j;
  j.out = r.out + r.err;
  EXPECT_EQ(r.status, 0) << j.out;
  const std::regex step(R"(step (\d+) loss ([0-9.eE+-]+))");
  for (auto it = std::sregex_iterator(r.out.begin(), r.out.end(), step); it != std::sregex_iterator(); ++it)
    j.losses[std::stoi((*it)[1])] = std::stod((*it)[2]);
  return j;
}

std::map<std::string, cohort::NamedTensor> model_at(const std::string& dir) {
  const auto ck = cohort::load_latest_valid(dir);
  std::map<std::string, cohort::NamedTensor> out;
  if (!ck) {
    ADD_FAILURE() << "no checkpoint in " << dir;
    return out;
  }
  for (const auto& [file, tensors] : ck->files)  // "model-stageN" per pipeline stage
    if (file.rfind("model", 0) == 0)
      for (const auto& t : tensors) out[t.name] = t;
  return out;
}

// Largest |a - b| / max(|b|, 1e-3) over every element of every tensor (f64).
double rel_error(const std::map<std::string, cohort::NamedTensor>& got,
                 const std::map<std::string, cohort::NamedTensor>& want) {
  double worst = 0;
  EXPECT_EQ(got.size(), want.size());
  for (const auto& [name, b] : want) {
    const auto it = got.find(name);
    if (it == got.end() || it->second.shape != b.shape) {
      ADD_FAILURE() << name << " is missing or has another shape";
      return 1e9;
    }
    const auto* x = reinterpret_cast<const double*>(it->second.bytes.data());
    const auto* y = reinterpret_cast<const double*>(b.bytes.data());
    for (size_t i = 0; i < b.bytes.size() / sizeof(double); ++i)
      worst = std::max(worst, std::abs(x[i] - y[i]) / std::max(std::abs(y[i]), 1e-3));
  }
  return worst;
}

double loss_error(const Job& got, const Job& want) {
  double worst = 0;
  EXPECT_EQ(got.losses.size(), want.losses.size()) << got.out;
  for (const auto& [s, l] : want.losses) {
    if (!got.losses.count(s)) return 1e9;
    worst = std::max(worst, std::abs(got.losses.at(s) - l) / std::abs(l));
  }
  return worst;
}

TEST(GptParallel, LayoutsTrainAsOneProcess) {
  need_text();
  const std::string base = lt::temp_dir();
  const Job ref = train(1, {}, base + "/ref", 20);
  ASSERT_EQ(ref.losses.size(), 20u) << ref.out;
  const auto ref_model = model_at(base + "/ref");
  struct Layout {
    int nproc;
    std::vector<std::string> args;
  };
  for (const auto& l : std::vector<Layout>{
           {2, {"--tp", "2"}},
           {2, {"--tp", "2", "--sequence-parallel"}},
           {2, {"--pp", "2", "--micro", "4"}},
           {2, {"--pp", "2", "--micro", "4", "--schedule", "gpipe"}},
           {2, {"--pp", "2", "--micro", "4", "--schedule", "interleaved", "--chunks", "2"}},
           {4, {"--tp", "2", "--dp", "2"}},
           {4, {"--tp", "4", "--sequence-parallel"}},
           {8, {"--dp", "2", "--tp", "2", "--pp", "2", "--micro", "2"}}}) {
    std::string name;
    for (const auto& a : l.args) name += a + " ";
    SCOPED_TRACE(name);
    std::string dir = base + "/";
    for (const auto& a : l.args) dir += a.substr(a.find_first_not_of('-'));
    const Job j = train(l.nproc, l.args, dir, 20);
    EXPECT_LT(loss_error(j, ref), 1e-5);
    EXPECT_LT(rel_error(model_at(dir), ref_model), 1e-5);
  }
  fs::remove_all(base);
}

// The losses of `got`, which must be those of `want` at the same steps.
double loss_error_at(const Job& got, const Job& want) {
  double worst = got.losses.empty() ? 1e9 : 0;
  for (const auto& [s, l] : got.losses) {
    if (!want.losses.count(s)) return 1e9;
    worst = std::max(worst, std::abs(l - want.losses.at(s)) / std::abs(want.losses.at(s)));
  }
  return worst;
}

// A checkpoint holds the full model and AdamW's moments, so a run stopped at
// step 10 at tp 2 resumes exactly (losses and parameters of an uninterrupted
// run) in one process, at dp 2 x tp 2 and in a 2-stage pipeline, and the
// pipeline's checkpoint (one file per stage) resumes back in one process.
TEST(GptParallel, CheckpointResumesExactlyAtAnotherLayout) {
  need_text();
  const std::string base = lt::temp_dir();
  const std::vector<std::string> fixed{"--decay-steps", "16"};  // one schedule, however the run is cut
  auto with = [&](std::vector<std::string> layout) {
    layout.insert(layout.end(), fixed.begin(), fixed.end());
    return layout;
  };
  const Job ref = train(1, with({}), base + "/ref", 16);
  ASSERT_EQ(ref.losses.size(), 16u) << ref.out;
  const Job first = train(2, with({"--tp", "2"}), base + "/a", 10);
  ASSERT_EQ(first.losses.size(), 10u) << first.out;
  EXPECT_LT(loss_error_at(first, ref), 1e-5);
  const Job one = train(1, with({}), base + "/b", 14, base + "/a");
  const Job four = train(4, with({"--tp", "2", "--dp", "2"}), base + "/c", 14, base + "/a");
  const Job piped = train(4, with({"--tp", "2", "--pp", "2", "--micro", "2"}), base + "/d", 14, base + "/a");
  EXPECT_NE(one.out.find("(step 10)"), std::string::npos) << one.out;
  for (const Job* j : {&one, &four, &piped}) {
    EXPECT_EQ(j->losses.size(), 4u) << j->out;
    EXPECT_LT(loss_error_at(*j, ref), 1e-5) << j->out;
  }
  EXPECT_LT(rel_error(model_at(base + "/c"), model_at(base + "/b")), 1e-5);
  EXPECT_LT(rel_error(model_at(base + "/d"), model_at(base + "/b")), 1e-5);
  const Job back = train(1, with({}), base + "/e", 16, base + "/d");
  EXPECT_EQ(back.losses.size(), 2u) << back.out;
  EXPECT_LT(loss_error_at(back, ref), 1e-5);
  EXPECT_LT(rel_error(model_at(base + "/e"), model_at(base + "/ref")), 1e-5);
  fs::remove_all(base);
}

// SIGTERM to `cohort run` at tp 2: the ranks agree on a step, save it (an
// unsharded checkpoint, as at an epoch's end) and exit 143; --load continues
// from that step with the losses of one process never stopped.
TEST(GptParallel, ASigtermSavesTheAgreedStepAndLoadContinuesFromIt) {
  need_text();
  const std::string base = lt::temp_dir();
  const std::vector<std::string> fixed{"--decay-steps", "300", "--epoch-steps", "20", "--epochs", "15"};
  auto with = [&](std::vector<std::string> layout) {
    layout.insert(layout.end(), fixed.begin(), fixed.end());
    return layout;
  };
  const Job ref = train(1, with({}), base + "/ref", 300);
  ASSERT_EQ(ref.losses.size(), 300u) << ref.out;

  std::vector<std::string> args{"run", "--standalone", "--nproc-per-node", "2", COHORT_GPT_BIN, "--tp", "2",
                                "--max-steps", "300", "--save", base + "/a"};
  for (const auto& v : {kModel, fixed}) args.insert(args.end(), v.begin(), v.end());
  auto env = kEnv;
  env["COHORT_TERM_TIMEOUT"] = "30s";  // time enough for a step and a save on a busy machine
  lt::Proc run(args, env);
  ASSERT_TRUE(lt::wait_for_file(base + "/a/step_000000020/manifest.json")) << "no step-20 checkpoint appeared";
  kill(run.pid(), SIGTERM);
  const auto stopped = run.wait(120);
  EXPECT_EQ(stopped.status, 128 + SIGTERM) << stopped.out << stopped.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(stopped.out, m, std::regex(R"(stopped at step (\d+): SIGTERM reached the job)")))
      << stopped.out << stopped.err;
  const int at = std::stoi(m[1]);
  ASSERT_GE(at, 20);
  ASSERT_LT(at, 300) << "the run ended before the signal: no stop was tested";

  const Job resumed = train(2, with({"--tp", "2"}), base + "/b", 300, base + "/a");
  EXPECT_NE(resumed.out.find("(step " + std::to_string(at) + ")"), std::string::npos) << resumed.out;
  EXPECT_EQ(resumed.losses.size(), static_cast<size_t>(300 - at)) << resumed.out;
  EXPECT_LT(loss_error_at(resumed, ref), 1e-5);
  fs::remove_all(base);
}

TEST(GptParallel, WeightsPerRankAtTp2AreHalfTheModel) {
  need_text();
  const std::string base = lt::temp_dir();
  // The example's own model (4 blocks of width 128): the replicated norms,
  // position table and row-parallel biases are 1.3% of it.
  const Job j = train(2, {"--tp", "2"}, base + "/m", 1, "", {"--print-every", "1"});
  std::smatch m;
  ASSERT_TRUE(std::regex_search(j.out, m, std::regex(R"(params=(\d+) params_per_rank=(\d+))"))) << j.out;
  const double whole = std::stod(m[1]), mine = std::stod(m[2]);
  EXPECT_LT(std::abs(mine / (whole / 2) - 1), 0.02) << mine << " of " << whole;
  fs::remove_all(base);
}

// `cohort run --nnodes 2` (two launchers on 127.0.0.1 play two nodes of 2
// processes): the mesh keeps each tp group inside a node, a pipeline runs its
// stages across the nodes, both train as one process; a tp group that would
// span the nodes is refused on every rank.
TEST(GptParallel, TwoNodesKeepTpInsideANode) {
  need_text();
  const std::string base = lt::temp_dir();
  const Job ref = train(1, {}, base + "/ref", 6);
  auto nodes = [&](const std::vector<std::string>& layout, const std::string& dir) {
    const int port = lt::free_port_pair();
    std::vector<std::unique_ptr<lt::Proc>> procs;
    for (int node : {1, 0}) {
      std::vector<std::string> args{"run", "--nnodes", "2", "--node_rank", std::to_string(node), "--nproc-per-node", "2",
                                    "--master-addr", "127.0.0.1", "--master-port", std::to_string(port), COHORT_GPT_BIN,
                                    "--max-steps", "6", "--save", dir};
      args.insert(args.end(), kModel.begin(), kModel.end());
      args.insert(args.end(), layout.begin(), layout.end());
      auto env = kEnv;
      env["COHORT_RDZV_TIMEOUT"] = "60s";
      procs.push_back(std::make_unique<lt::Proc>(args, env));
    }
    auto r1 = procs[0]->wait(300), r0 = procs[1]->wait(300);
    return std::make_pair(r0, r1);
  };
  for (const auto& layout : std::vector<std::vector<std::string>>{{"--tp", "2", "--dp", "2"},
                                                                  {"--tp", "2", "--pp", "2", "--micro", "4"}}) {
    const auto [r0, r1] = nodes(layout, base + "/" + layout.back());
    ASSERT_EQ(r0.status, 0) << r0.out << r0.err;
    ASSERT_EQ(r1.status, 0) << r1.out << r1.err;
    Job j;
    j.out = r0.out;
    const std::regex step(R"(step (\d+) loss ([0-9.eE+-]+))");
    for (auto it = std::sregex_iterator(r0.out.begin(), r0.out.end(), step); it != std::sregex_iterator(); ++it)
      j.losses[std::stoi((*it)[1])] = std::stod((*it)[2]);
    EXPECT_LT(loss_error(j, ref), 1e-5) << layout.back();
  }
  const auto [r0, r1] = nodes({"--tp", "4"}, base + "/tp4");
  EXPECT_NE(r0.status, 0);
  EXPECT_NE(r0.status, -1) << "hung";
  EXPECT_NE(r1.status, -1) << "hung";
  EXPECT_NE((r0.out + r0.err).find("spans nodes 0 and 1 (GROUP_RANK)"), std::string::npos) << r0.out << r0.err;
  fs::remove_all(base);
}

// With dropout the run draws masks (its losses differ from the run without)
// and still learns, at tp 2 with sequence parallelism too.
TEST(GptParallel, DropoutTrains) {
  need_text();
  const std::string base = lt::temp_dir();
  const Job plain = train(2, {"--tp", "2"}, base + "/a", 20);
  for (const auto& layout : std::vector<std::vector<std::string>>{{"--tp", "2", "--dropout", "0.1"},
                                                                  {"--tp", "2", "--dropout", "0.1", "--sequence-parallel"}}) {
    const Job j = train(2, layout, base + "/" + layout.back(), 20);
    ASSERT_EQ(j.losses.size(), 20u) << j.out;
    EXPECT_GT(std::abs(j.losses.at(20) - plain.losses.at(20)), 1e-6) << "no mask was drawn";
    EXPECT_LT(j.losses.at(20), j.losses.at(1) - 0.3) << j.out;
  }
  fs::remove_all(base);
}

// With dropout, a resume at the layout that saved restores every rank's
// dropout streams: the masks, so the losses, continue as in a run never
// stopped. At another layout they start afresh, and it says so.
TEST(GptParallel, DropoutResumesExactlyAtTheSameLayout) {
  need_text();
  const std::string base = lt::temp_dir();
  const std::vector<std::string> layout{"--tp", "2", "--dropout", "0.1", "--decay-steps", "12"};
  const Job ref = train(2, layout, base + "/ref", 12);
  ASSERT_EQ(ref.losses.size(), 12u) << ref.out;
  const Job first = train(2, layout, base + "/a", 6);
  const Job again = train(2, layout, base + "/b", 12, base + "/a");
  ASSERT_EQ(again.losses.size(), 6u) << again.out;
  for (const auto& [s, l] : again.losses) EXPECT_EQ(l, ref.losses.at(s)) << "step " << s << "\n" << again.out;
  EXPECT_EQ(again.out.find("start afresh"), std::string::npos) << again.out;
  const Job other = train(1, {"--dropout", "0.1", "--decay-steps", "12"}, base + "/c", 8, base + "/a");
  EXPECT_NE(other.out.find("the dropout masks start afresh"), std::string::npos) << other.out;
  fs::remove_all(base);
}

// --recompute runs every block again in backward (its tp collectives and
// dropout masks included): the same losses and weights as without, with
// dropout on, with tensor parallelism and through an interleaved pipeline
// with DDP.
TEST(GptParallel, RecomputeTrainsAsWithout) {
  need_text();
  const std::string base = lt::temp_dir();
  for (const auto& layout : std::vector<std::vector<std::string>>{
           {"--tp", "2", "--dropout", "0.1", "--sequence-parallel"},
           {"--pp", "2", "--dp", "2", "--micro", "2", "--schedule", "interleaved", "--chunks", "2", "--dropout", "0.1"}}) {
    const int nproc = layout.front() == "--tp" ? 2 : 4;
    const Job plain = train(nproc, layout, base + "/plain", 6);
    auto with = layout;
    with.push_back("--recompute");
    const Job again = train(nproc, with, base + "/again", 6);
    ASSERT_EQ(again.losses.size(), 6u) << again.out;
    EXPECT_EQ(loss_error(again, plain), 0.0) << again.out;
    EXPECT_EQ(rel_error(model_at(base + "/again"), model_at(base + "/plain")), 0.0);
    EXPECT_NE(again.out.find("recompute=1"), std::string::npos) << again.out;
    fs::remove_all(base + "/plain");
    fs::remove_all(base + "/again");
  }
  fs::remove_all(base);
}

// Each exits non-zero with the reason, long before any timeout.
TEST(GptParallel, BadLayoutsFailAtOnceByName) {
  need_text();
  struct Bad {
    int nproc;
    std::vector<std::string> args;
    std::string says;
  };
  for (const auto& b : std::vector<Bad>{
           {2, {"--tp", "3"}, "--heads 4 does not divide by the tensor-parallel degree 3"},
           {4, {"--tp", "2", "--dp", "3"}, "dp 3 x tp 2 x pp 1 = 6 ranks, but the world has 4"},
           {2, {"--tp", "2", "--dim", "66"}, "--dim 66 does not divide by --heads 4"},
           {4, {"--tp", "4", "--sequence-parallel", "--context", "30"}, "--context 30 must divide by --tp 4"},
           {2, {"--dp", "2", "--batch", "7"}, "--batch 7 does not split into --dp 2 x --micro 1"},
           {2, {"--pp", "2", "--schedule", "interleaved", "--chunks", "2", "--layers", "3", "--micro", "2"},
            "--layers 3 cannot fill 4 pipeline stages (--pp 2 x --chunks 2)"},
           {2, {"--pp", "2", "--schedule", "interleaved", "--chunks", "2", "--micro", "3"},
            "3 micro-batches do not divide by 2 stages"},
           {2, {"--pp", "2", "--schedule", "zero-bubble"}, "use gpipe, 1f1b or interleaved"},
           {2, {"--tp", "2", "--dropout", "1.5"}, "--dropout 1.500000 is outside [0, 1)"}}) {
    std::vector<std::string> args{"run", "--standalone", "--nproc-per-node", std::to_string(b.nproc), COHORT_GPT_BIN,
                                  "--max-steps", "1"};
    args.insert(args.end(), b.args.begin(), b.args.end());
    const auto r = lt::run(args, kEnv, 120);
    EXPECT_NE(r.status, 0) << r.out << r.err;
    EXPECT_NE(r.status, -1) << "hung: " << r.out << r.err;
    EXPECT_NE((r.out + r.err).find(b.says), std::string::npos) << r.out << r.err;
  }
}

}  // namespace
