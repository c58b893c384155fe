// `cohort run` end to end, single node: real processes through the cohort
// binary (tests/progs/launch_env.cpp and launch_behave.cpp are the workers).
// Every run has a generous deadline; the only timing checks are upper bounds
// far below the workers' own sleeps. Multi-node cases: launcher_multinode_test.cpp.
#include <gtest/gtest.h>

#include <signal.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "launch_harness.hpp"
#include "test_deps.hpp"

namespace lt = launch_test;
namespace fs = std::filesystem;

namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// rank -> (KEY -> VALUE) from launch_env's "[rankR]: KEY=VALUE" lines.
std::map<int, std::map<std::string, std::string>> env_by_rank(const std::string& out, int nranks) {
  std::map<int, std::map<std::string, std::string>> m;
  for (int r = 0; r < nranks; ++r)
    for (const auto& line : lt::lines_with(out, "[rank" + std::to_string(r) + "]: ")) {
      auto eq = line.find('=');
      if (eq != std::string::npos) m[r][line.substr(0, eq)] = line.substr(eq + 1);
    }
  return m;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST(Launcher, EnvContractForThreeWorkers) {
  int port = lt::free_port_pair();
  ASSERT_GT(port, 0);
  auto r = lt::run({"run", "--nproc_per_node", "3", "--master-port", std::to_string(port), "--rdzv-id", "myjob",
                    "--max-restarts", "2", lt::prog("launch_env")});
  ASSERT_EQ(r.status, 0) << r.err;
  auto env = env_by_rank(r.out, 3);
  ASSERT_EQ(env.size(), 3u) << r.out;
  std::set<std::string> run_ids;
  for (int rank = 0; rank < 3; ++rank) {
    auto& e = env[rank];
    std::string R = std::to_string(rank);
    EXPECT_EQ(e["RANK"], R);
    EXPECT_EQ(e["LOCAL_RANK"], R);
    EXPECT_EQ(e["WORLD_SIZE"], "3");
    EXPECT_EQ(e["LOCAL_WORLD_SIZE"], "3");
    EXPECT_EQ(e["GROUP_RANK"], "0");
    EXPECT_EQ(e["GROUP_WORLD_SIZE"], "1");
    EXPECT_EQ(e["ROLE_RANK"], R);
    EXPECT_EQ(e["ROLE_WORLD_SIZE"], "3");
    EXPECT_EQ(e["ROLE_NAME"], "default");
    EXPECT_EQ(e["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(e["MASTER_PORT"], std::to_string(port));
    EXPECT_EQ(e["TORCHELASTIC_RESTART_COUNT"], "0");
    EXPECT_EQ(e["TORCHELASTIC_MAX_RESTARTS"], "2");
    EXPECT_EQ(e["TORCHELASTIC_RUN_ID"], "myjob");
    EXPECT_EQ(e["TORCHELASTIC_USE_AGENT_STORE"], "False");
    EXPECT_EQ(e["OMP_NUM_THREADS"], "1");
    EXPECT_EQ(e["COHORT_STORE_ADDR"], "127.0.0.1");
    EXPECT_EQ(e["COHORT_STORE_PORT"], std::to_string(port + 1));
    EXPECT_EQ(e["COHORT_RUN_ID"].rfind("myjob-", 0), 0u) << e["COHORT_RUN_ID"];
    run_ids.insert(e["COHORT_RUN_ID"]);
  }
  EXPECT_EQ(run_ids.size(), 1u) << "every worker of a job shares COHORT_RUN_ID";
  EXPECT_TRUE(contains(r.err, "OMP_NUM_THREADS=1")) << r.err;
}

TEST(Launcher, StandalonePicksSeparatePortsAndKeepsUserOmp) {
  auto r = lt::run({"run", "--standalone", "--nproc-per-node", "2", lt::prog("launch_env")}, {{"OMP_NUM_THREADS", "4"}});
  ASSERT_EQ(r.status, 0) << r.err;
  auto env = env_by_rank(r.out, 2);
  ASSERT_EQ(env.size(), 2u) << r.out;
  EXPECT_NE(env[0]["MASTER_PORT"], env[0]["COHORT_STORE_PORT"]);
  EXPECT_NE(env[0]["MASTER_PORT"], "0");
  EXPECT_NE(env[0]["COHORT_STORE_PORT"], "0");
  EXPECT_EQ(env[0]["OMP_NUM_THREADS"], "4");
  EXPECT_FALSE(contains(r.err, "OMP_NUM_THREADS")) << r.err;
  EXPECT_NE(env[0]["TORCHELASTIC_RUN_ID"], "none");  // --standalone makes one up, as torchrun does
}

// Workers get fixed malloc thresholds (launch/worker_env.hpp) unless the user
// set glibc's variables or COHORT_MALLOC_TUNING=0.
TEST(Launcher, WorkersGetMallocThresholdsUnlessTheUserSetThem) {
  const std::map<std::string, std::string> clean{{"GLIBC_TUNABLES", ""}, {"MALLOC_TRIM_THRESHOLD_", ""}, {"MALLOC_MMAP_THRESHOLD_", ""}};
  auto run = [&](std::map<std::string, std::string> extra) {
    auto env = clean;
    for (auto& [k, v] : extra) env[k] = v;
    auto r = lt::run({"run", "--standalone", "--nproc-per-node", "2", lt::prog("launch_env")}, env);
    EXPECT_EQ(r.status, 0) << r.err;
    auto by_rank = env_by_rank(r.out, 2);
    EXPECT_EQ(by_rank.size(), 2u) << r.out;
    return by_rank;
  };
  auto tuned = run({});
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(tuned[rank]["GLIBC_TUNABLES"].find("glibc.malloc.trim_threshold="), std::string::npos) << rank;
    EXPECT_NE(tuned[rank]["GLIBC_TUNABLES"].find("glibc.malloc.mmap_threshold="), std::string::npos) << rank;
  }
  EXPECT_EQ(run({{"GLIBC_TUNABLES", "glibc.malloc.arena_max=2"}})[1]["GLIBC_TUNABLES"], "glibc.malloc.arena_max=2");
  EXPECT_EQ(run({{"MALLOC_TRIM_THRESHOLD_", "1048576"}})[0]["GLIBC_TUNABLES"].find("malloc"), std::string::npos);
  EXPECT_EQ(run({{"COHORT_MALLOC_TUNING", "0"}})[0]["GLIBC_TUNABLES"].find("malloc"), std::string::npos);
}

TEST(Launcher, ProgramArgumentsPassThroughUntouched) {
  auto r = lt::run({"run", "--standalone", "--nproc-per-node", "1", lt::prog("launch_env"), "--nproc-per-node", "5",
                    "-m", "--master-port=1", "--", "plain", "--help"});
  ASSERT_EQ(r.status, 0) << r.err;
  auto args = lt::lines_with(r.out, "[rank0]: ARG");
  std::vector<std::string> want = {"1=--nproc-per-node", "2=5", "3=-m", "4=--master-port=1", "5=--", "6=plain",
                                   "7=--help"};
  EXPECT_EQ(args, want) << r.out;
  auto env = env_by_rank(r.out, 1);
  EXPECT_EQ(env[0]["WORLD_SIZE"], "1");
}

// torchrun reads every flag's default from PET_<FLAG> (Kubeflow's PyTorchJob
// configures it that way); the command line still wins.
TEST(Launcher, PetEnvironmentVariablesAreFlagDefaults) {
  auto r = lt::run({"run", lt::prog("launch_env")},
                   {{"PET_NPROC_PER_NODE", "2"}, {"PET_STANDALONE", "1"}, {"PET_ROLE", "trainer"}});
  ASSERT_EQ(r.status, 0) << r.err;
  auto env = env_by_rank(r.out, 2);
  EXPECT_EQ(env[1]["WORLD_SIZE"], "2");
  EXPECT_EQ(env[1]["ROLE_NAME"], "trainer");
  auto flag_wins = lt::run({"run", "--nproc-per-node", "1", lt::prog("launch_env")},
                           {{"PET_NPROC_PER_NODE", "2"}, {"PET_STANDALONE", "1"}});
  ASSERT_EQ(flag_wins.status, 0) << flag_wins.err;
  EXPECT_EQ(env_by_rank(flag_wins.out, 1)[0]["WORLD_SIZE"], "1");
}

// torchrun's recipe for several single-node jobs on one machine: a c10d
// rendezvous on port 0. Each job gets free ports of its own.
TEST(Launcher, OneNodeC10dPicksFreePortsLikeStandalone) {
  std::vector<std::string> ports;
  for (int job = 0; job < 2; ++job) {
    auto r = lt::run({"run", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--nnodes=1", lt::prog("launch_env")});
    ASSERT_EQ(r.status, 0) << r.err;
    ports.push_back(env_by_rank(r.out, 1)[0]["MASTER_PORT"]);
    EXPECT_NE(ports.back(), "29500");
  }
}

TEST(Launcher, PythonScriptsAndModulesRunWithPython) {
  if (system("python3 -c pass >/dev/null 2>&1") != 0) COHORT_MISSING_DEP("no python3");
  std::string dir = lt::temp_dir();
  std::ofstream(dir + "/show.py") << "import os, sys\nprint('py', os.environ['RANK'], sys.argv[1:])\n";
  auto r = lt::run({"run", "--standalone", "--nproc-per-node", "2", dir + "/show.py", "--lr", "1"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "[rank1]: py 1 ['--lr', '1']")) << r.out;
  auto m = lt::run({"run", "--standalone", "-m", "show", "x"}, {{"PYTHONPATH", dir}});
  ASSERT_EQ(m.status, 0) << m.err;
  EXPECT_TRUE(contains(m.out, "[rank0]: py 0 ['x']")) << m.out;
  fs::remove_all(dir);
}

TEST(Launcher, PrefixesLinesAndKeepsStreamsApart) {
  auto r = lt::run({"run", "--standalone", "--nproc-per-node", "2", lt::prog("launch_behave"), "say=hello",
                    "warn=oops", "partial"});
  ASSERT_EQ(r.status, 0) << r.err;
  for (std::string rank : {"0", "1"}) {
    EXPECT_TRUE(contains(r.out, "[rank" + rank + "]: hello\n")) << r.out;
    EXPECT_TRUE(contains(r.out, "[rank" + rank + "]: partial\n")) << "a line written in two parts stays whole\n"
                                                                       << r.out;
    EXPECT_TRUE(contains(r.err, "[rank" + rank + "]: oops\n")) << r.err;
  }
  EXPECT_FALSE(contains(r.out, "oops"));
  EXPECT_FALSE(contains(r.err, "hello"));
}

TEST(Launcher, FailingRankStopsTheOthers) {
  std::string dir = lt::temp_dir();
  lt::Proc p({"run", "--standalone", "--nproc-per-node", "2", lt::prog("launch_behave"), "pid_dir=" + dir,
              "fail_rank=1", "code=3", "delay_ms=300", "sleep=120"});
  auto pids = lt::wait_pid_files(dir, 2);
  auto r = p.wait(60);
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_LT(r.seconds, 60) << "the sleeping rank was not stopped";
  EXPECT_TRUE(contains(r.err, "cohort run: rank 1 (local 1, pid ")) << r.err;
  EXPECT_TRUE(contains(r.err, ") exited with code 3; stopped the other 1 worker(s)")) << r.err;
  ASSERT_EQ(pids.size(), 2u);
  EXPECT_TRUE(lt::wait_gone(pids[0]));
  fs::remove_all(dir);
}

TEST(Launcher, RankKilledBySignalIsNamed) {
  auto r = lt::run({"run", "--standalone", "--nproc-per-node", "2", lt::prog("launch_behave"), "kill_rank=0",
                    "sleep=120"});
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_TRUE(contains(r.err, "rank 0 (local 0, pid ")) << r.err;
  EXPECT_TRUE(contains(r.err, "was killed by signal 9 (SIGKILL)")) << r.err;
}

TEST(Launcher, WorkerIgnoringSigtermGetsSigkill) {
  std::string dir = lt::temp_dir();
  lt::Proc p({"run", "--standalone", "--nproc-per-node", "2", lt::prog("launch_behave"), "pid_dir=" + dir,
              "ignore_term", "fail_rank=1", "code=5", "delay_ms=300", "sleep=120"},
             {{"COHORT_TERM_TIMEOUT", "500ms"}});
  auto pids = lt::wait_pid_files(dir, 2);
  auto r = p.wait(60);
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_TRUE(contains(r.err, "exited with code 5")) << r.err;
  ASSERT_EQ(pids.size(), 2u);
  EXPECT_TRUE(lt::wait_gone(pids[0]));
  fs::remove_all(dir);
}

TEST(Launcher, SigtermToLauncherStopsWorkers) {
  std::string dir = lt::temp_dir();
  lt::Proc p({"run", "--standalone", "--nproc-per-node", "2", lt::prog("launch_behave"), "pid_dir=" + dir,
              "sleep=120"});
  auto pids = lt::wait_pid_files(dir, 2);
  ASSERT_EQ(pids.size(), 2u);
  kill(p.pid(), SIGTERM);
  auto r = p.wait(60);
  EXPECT_EQ(r.status, 128 + SIGTERM) << r.err;
  EXPECT_TRUE(contains(r.err, "received SIGTERM; stopped 2 worker(s)")) << r.err;
  for (pid_t pid : pids) EXPECT_TRUE(lt::wait_gone(pid));
  fs::remove_all(dir);
}

// The launcher's stdout is a pipe nobody reads (a paused pager, a stuck
// `| tee`), and the workers print more than it and the launcher's queue hold:
// a SIGTERM must still stop the job and end the launcher, without anyone
// reading its output first (the launcher used to block in write() and never
// see the signal).
TEST(Launcher, AStuckConsoleDoesNotKeepTheLauncherFromStopping) {
  std::string dir = lt::temp_dir();
  lt::Proc p({"run", "--standalone", "--nproc-per-node", "2", lt::prog("launch_behave"), "pid_dir=" + dir,
              "lines=300000", "sleep=120"});
  auto pids = lt::wait_pid_files(dir, 2);
  ASSERT_EQ(pids.size(), 2u);
  std::this_thread::sleep_for(std::chrono::seconds(1));  // the output fills the pipe and the queue
  kill(p.pid(), SIGTERM);
  const bool ended = lt::wait_gone(p.pid(), 30);  // its output still unread
  auto r = p.wait(60);
  EXPECT_TRUE(ended) << "the launcher did not end while its stdout was not read";
  EXPECT_EQ(r.status, 128 + SIGTERM) << r.err;
  EXPECT_TRUE(contains(r.err, "received SIGTERM; stopped 2 worker(s)")) << r.err;
  for (pid_t pid : pids) EXPECT_TRUE(lt::wait_gone(pid));
  fs::remove_all(dir);
}

// Once the stuck console's output is given up after a stop signal, the
// workers' pipes are still read: a worker that prints while it shuts down
// finishes its shutdown (not killed by SIGPIPE or left blocked until
// SIGKILL), and its log file gets everything.
TEST(Launcher, AfterAStuckConsoleIsGivenUpWorkersStillShutDownCleanly) {
  std::string dir = lt::temp_dir();
  lt::Proc p({"run", "--standalone", "--nproc-per-node", "1", "--log-dir", dir + "/logs", "--tee", "3",
              "--run-id", "stuck", lt::prog("launch_behave"), "pid_dir=" + dir, "term_lines=200000", "lines=300000",
              "sleep=120"},
             {{"COHORT_TERM_TIMEOUT", "30s"}});
  auto pids = lt::wait_pid_files(dir, 1);
  ASSERT_EQ(pids.size(), 1u);
  std::this_thread::sleep_for(std::chrono::seconds(1));
  kill(p.pid(), SIGTERM);
  const bool ended = lt::wait_gone(p.pid(), 25);  // before the 30 s grace: the worker exited by itself
  auto r = p.wait(60);
  EXPECT_TRUE(ended) << "the launcher did not end while its stdout was not read";
  EXPECT_EQ(r.status, 128 + SIGTERM) << r.err;
  std::string log;
  for (const auto& e : fs::recursive_directory_iterator(dir + "/logs"))
    if (e.path().filename() == "stdout.log") {
      std::ifstream in(e.path());
      log.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
  EXPECT_NE(log.find("line 300000\n"), std::string::npos) << "the log file lost lines";
  EXPECT_NE(log.find("bye 200000\nbye done\n"), std::string::npos) << "the worker did not finish its shutdown";
  fs::remove_all(dir);
}

// A reader that falls behind loses nothing: every line of every rank arrives,
// whole and in order, and the job ends normally.
TEST(Launcher, ASlowConsoleGetsEveryLineInOrder) {
  constexpr long kLines = 300000;
  lt::Proc p({"run", "--standalone", "--nproc-per-node", "2", lt::prog("launch_behave"),
              "lines=" + std::to_string(kLines)});
  std::this_thread::sleep_for(std::chrono::seconds(2));  // nobody reads meanwhile
  auto r = p.wait(120);
  ASSERT_EQ(r.status, 0) << r.err;
  long next[2] = {1, 1};
  std::istringstream in(r.out);
  for (std::string line; std::getline(in, line);) {
    const int rank = line.rfind("[rank0]: line ", 0) == 0 ? 0 : line.rfind("[rank1]: line ", 0) == 0 ? 1 : -1;
    ASSERT_GE(rank, 0) << "unexpected line '" << line << "'";
    ASSERT_EQ(line.substr(14), std::to_string(next[rank])) << "rank " << rank;
    ++next[rank];
  }
  EXPECT_EQ(next[0], kLines + 1);
  EXPECT_EQ(next[1], kLines + 1);
}

// Slurm and Kubernetes signal every process of a job at once: a worker that
// fails just before the launcher's SIGTERM arrives must not turn the stop
// into a restart (exit 143, not "restarting the workers"). The signal comes
// a moment after the exit, inside the launcher's 100 ms failure grace; should
// it come first, the answer is the same.
TEST(Launcher, AStopSignalDuringAFailureIsNotARestart) {
  lt::Proc p({"run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "/bin/sh", "-c",
              "if [ \"$LOCAL_RANK\" = 0 ]; then (kill -TERM $PPID) & exit 3; fi; exec sleep 60"},
             {{"COHORT_TERM_TIMEOUT", "2s"}});
  auto r = p.wait(60);
  EXPECT_EQ(r.status, 128 + SIGTERM) << r.err;
  EXPECT_FALSE(contains(r.err, "restarting the workers")) << r.err;
}

// Children a worker left behind that ignore SIGTERM are SIGKILLed with its
// process group when the launcher stops the job, even after the worker exited.
TEST(Launcher, LeftoverChildrenIgnoringSigtermAreKilled) {
  std::string dir = lt::temp_dir();
  lt::Proc p({"run", "--standalone", "--nproc-per-node", "2", "/bin/sh", "-c",
              "sh -c 'trap \"\" TERM; exec sleep 37' & echo $! > " + dir +
                  "/$LOCAL_RANK.pid; if [ \"$LOCAL_RANK\" = 0 ]; then sleep 0.3; exit 1; fi; exec sleep 60"},
             {{"COHORT_TERM_TIMEOUT", "500ms"}});
  auto r = p.wait(60);
  EXPECT_EQ(r.status, 1) << r.err;
  auto pids = lt::wait_pid_files(dir, 2);
  ASSERT_EQ(pids.size(), 2u);
  for (pid_t pid : pids) EXPECT_TRUE(lt::wait_gone(pid)) << "child pid " << pid << " outlived the launcher";
  fs::remove_all(dir);
}

TEST(Launcher, SigkilledLauncherLeavesNoOrphans) {
  std::string dir = lt::temp_dir();
  lt::Proc p({"run", "--standalone", "--nproc-per-node", "2", lt::prog("launch_behave"), "pid_dir=" + dir,
              "sleep=120"});
  auto pids = lt::wait_pid_files(dir, 2);
  ASSERT_EQ(pids.size(), 2u);
  kill(p.pid(), SIGKILL);
  p.wait(30);
  for (pid_t pid : pids) EXPECT_TRUE(lt::wait_gone(pid)) << "PR_SET_PDEATHSIG should have killed pid " << pid;
  fs::remove_all(dir);
}

TEST(Launcher, MaxRestartsRestartsFailedWorkers) {
  auto ok = lt::run({"run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", lt::prog("launch_behave"),
                     "fail_until_restart=1"});
  EXPECT_EQ(ok.status, 0) << ok.err;
  // Attempt 0: the first rank to fail stops the other, maybe before it printed.
  EXPECT_TRUE(contains(ok.out, "]: restart 0\n")) << ok.out;
  EXPECT_TRUE(contains(ok.out, "[rank0]: restart 1\n")) << ok.out;
  EXPECT_TRUE(contains(ok.out, "[rank1]: restart 1\n")) << ok.out;
  EXPECT_TRUE(contains(ok.err, "restarting the workers (restart 1 of 1)")) << ok.err;

  auto spent = lt::run({"run", "--standalone", "--nproc-per-node", "1", "--max_restarts=1", lt::prog("launch_behave"),
                        "fail_until_restart=5"});
  EXPECT_EQ(spent.status, 1) << spent.err;
  EXPECT_TRUE(contains(spent.err, "exited with code 3")) << spent.err;
  EXPECT_TRUE(contains(spent.err, "no restarts left (--max-restarts 1)")) << spent.err;

  auto none = lt::run({"run", "--standalone", lt::prog("launch_behave"), "fail_until_restart=1"});
  EXPECT_EQ(none.status, 1) << none.err;
}

TEST(Launcher, BadFlagsFailClearly) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  std::vector<Case> cases = {
      {{"run", "--nproc-per-node", "0", "true"}, "--nproc-per-node 0"},
      {{"run", "--nproc-per-node", "many", "true"}, "--nproc-per-node many"},
      {{"run", "--nnodes", "1:4", "true"}, "elastic membership (MIN < MAX) needs the dynamic rendezvous"},
      {{"run", "--nnodes", "x", "true"}, "--nnodes x"},
      {{"run", "--nnodes", "2", "--node-rank", "2", "true"}, "--node-rank 2 is outside 0..1"},
      {{"run", "--standalone"}, "missing PROGRAM"},
      {{"run", "--bogus-flag", "true"}, "unknown flag --bogus-flag"},
      {{"run", "--tee", "7", "true"}, "--tee 7"},
      {{"run", "--redirects", "0:3,x", "true"}, "--redirects 0:3,x"},
      {{"run", "--standalone", "no-such-program-xyz"}, "'no-such-program-xyz' was not found in PATH"},
      {{"run", "--standalone", "/nonexistent/train.py"}, "/nonexistent/train.py does not exist"},
      {{"run", "--no-python", "-m", "mod"}, "cannot be used together"},
  };
  for (const auto& c : cases) {
    auto r = lt::run(c.args);
    EXPECT_NE(r.status, 0) << c.args[1];
    EXPECT_TRUE(contains(r.err, c.message)) << "args " << c.args[1] << ": " << r.err;
  }
}

// A COHORT_* knob set to a value that does not parse stops `cohort run`
// before any worker starts, naming it, even one this job would never read
// (COHORT_RDZV_TIMEOUT on one node); `cohort env` marks it INVALID.
TEST(Launcher, BadKnobValuesFailBeforeAnyWorkerStarts) {
  auto r = lt::run({"run", "--standalone", "--nproc-per-node", "1", lt::prog("launch_env")},
                   {{"COHORT_RDZV_TIMEOUT", "abc"}, {"COHORT_SHARED_BUFFERS", "perhaps"}});
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(contains(r.err, "COHORT_RDZV_TIMEOUT=abc is not a duration")) << r.err;
  EXPECT_TRUE(contains(r.err, "COHORT_SHARED_BUFFERS=perhaps is not a boolean")) << r.err;
  EXPECT_FALSE(contains(r.out, "RANK=")) << "a worker started:\n" << r.out;
  auto env = lt::run({"env"}, {{"COHORT_RDZV_TIMEOUT", "abc"}});
  EXPECT_EQ(env.status, 1);
  EXPECT_TRUE(contains(env.out, "INVALID: COHORT_RDZV_TIMEOUT=abc is not a duration")) << env.out;
  auto fine = lt::run({"env"}, {{"COHORT_RDZV_TIMEOUT", "90s"}});
  EXPECT_EQ(fine.status, 0) << fine.err;
}

TEST(Launcher, LogDirGetsPerRankFilesAndRedirectsHideConsole) {
  std::string dir = lt::temp_dir();
  auto r = lt::run({"run", "--standalone", "--nproc-per-node", "2", "--log-dir", dir, "--redirects", "3", "--tee",
                    "0:1", "--rdzv-id", "logs", lt::prog("launch_behave"), "say=to-out", "warn=to-err"});
  ASSERT_EQ(r.status, 0) << r.err;
  // Rank 0's stdout is teed to the console; everything else only reaches the files.
  EXPECT_TRUE(contains(r.out, "[rank0]: to-out")) << r.out;
  EXPECT_FALSE(contains(r.out, "[rank1]")) << r.out;
  EXPECT_FALSE(contains(r.err, "[rank")) << r.err;
  std::vector<fs::path> runs(fs::directory_iterator(dir), fs::directory_iterator{});
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0].filename().string().rfind("logs-", 0), 0u) << runs[0];
  for (int lr = 0; lr < 2; ++lr) {
    fs::path d = runs[0] / "attempt_0" / std::to_string(lr);
    EXPECT_EQ(read_file(d / "stdout.log"), "to-out\n") << d;
    EXPECT_EQ(read_file(d / "stderr.log"), "to-err\n") << d;
  }
  fs::remove_all(dir);
}

TEST(Launcher, RemovesSharedMemoryLeftByCrashedWorkers) {
  if (!fs::is_directory("/dev/shm")) GTEST_SKIP() << "no /dev/shm";
  auto r = lt::run({"run", "--standalone", "--nproc-per-node", "2", lt::prog("launch_behave"), "shm", "fail_rank=0",
                    "code=4"});
  EXPECT_EQ(r.status, 1) << r.err;
  auto paths = lt::lines_with(r.out, "[rank1]: SHM=");
  ASSERT_EQ(paths.size(), 1u) << r.out;
  EXPECT_FALSE(fs::exists(paths[0])) << paths[0];
  auto paths0 = lt::lines_with(r.out, "[rank0]: SHM=");
  ASSERT_EQ(paths0.size(), 1u) << r.out;
  EXPECT_FALSE(fs::exists(paths0[0])) << paths0[0];
}

}  // namespace
