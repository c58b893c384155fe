// The launcher's pure pieces, called directly: flag parsing, port resolution,
// the worker environment, output line prefixing, run ids and shm cleanup.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "cohort/error.hpp"
#include "launch/options.hpp"
#include "launch/output.hpp"
#include "launch/run_id.hpp"
#include "launch/worker_env.hpp"

using namespace cohort::launch;
using cohort::InvalidArgument;

TEST(LaunchOptions, StdSpecWholeAndPerRank) {
  EXPECT_EQ(parse_std_spec("3", "--tee").for_rank(5), kStdBoth);
  EXPECT_FALSE(parse_std_spec("0", "--tee").any());
  StdSpec s = parse_std_spec("0:3,2:1", "--redirects");
  EXPECT_EQ(s.for_rank(0), kStdBoth);
  EXPECT_EQ(s.for_rank(1), kStdNone);
  EXPECT_EQ(s.for_rank(2), kStdOut);
  EXPECT_TRUE(s.any());
  for (const char* bad : {"4", "", "x", "0:4", "0:3,0:1", ":3", "1:", "-1"})
    EXPECT_THROW(parse_std_spec(bad, "--tee"), InvalidArgument) << bad;
}

TEST(LaunchOptions, NprocAndNnodes) {
  EXPECT_EQ(parse_nproc("4"), 4);
  EXPECT_EQ(parse_nproc("auto"), cpu_count());
  EXPECT_EQ(parse_nproc("cpu"), cpu_count());
  EXPECT_GE(cpu_count(), 1);
  for (const char* bad : {"0", "-2", "two", "gpu", ""}) EXPECT_THROW(parse_nproc(bad), InvalidArgument) << bad;
  // A count past any node's cores would only exhaust the machine before the job starts.
  EXPECT_EQ(parse_nproc("4096"), 4096);
  for (const char* bad : {"4097", "100000", "999999999"}) {
    try {
      parse_nproc(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("at most 4096"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(parse_nnodes("3").min, 3);
  EXPECT_EQ(parse_nnodes("3").max, 3);
  EXPECT_EQ(parse_nnodes("2:2").max, 2);
  EXPECT_EQ(parse_nnodes("1:4").min, 1);
  EXPECT_EQ(parse_nnodes("1:4").max, 4);
  for (const char* bad : {"0", "2:1", "a:b", ":", "x"}) EXPECT_THROW(parse_nnodes(bad), InvalidArgument) << bad;
}

TEST(LaunchOptions, Endpoint) {
  auto hp = parse_endpoint("node0:1234", 9);
  EXPECT_EQ(hp.host, "node0");
  EXPECT_EQ(hp.port, 1234);
  EXPECT_EQ(parse_endpoint("node0", 9).port, 9);
  EXPECT_EQ(parse_endpoint("[::1]:80", 9).host, "::1");
  for (const char* bad : {":80", "h:0", "h:99999", "h:x", "::1:80", "[::1"})
    EXPECT_THROW(parse_endpoint(bad, 9), InvalidArgument) << bad;
}

TEST(LaunchOptions, BracketedIpv6MasterAddrReachesWorkersBare) {
  LaunchOptions o;
  o.command = {"prog"};
  o.master_addr = "[::1]";  // torchrun's help asks for brackets; MASTER_ADDR must be the bare address
  o.master_addr_given = true;
  EXPECT_EQ(resolve_endpoints(o).master_addr, "::1");
  o.standalone = true;
  EXPECT_EQ(resolve_endpoints(o).master_addr, "::1");
}

TEST(LaunchOptions, EndpointsKeepTheStoreOffMasterPort) {
  LaunchOptions o;
  o.command = {"prog"};
  Endpoints e = resolve_endpoints(o);
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, 29500);
  EXPECT_EQ(e.store_port, 29501);
  EXPECT_EQ(e.store_bind, "127.0.0.1");

  o.nnodes = 2;
  o.rdzv_endpoint = "head:29500";  // a torchrun habit: the endpoint on the default master port
  e = resolve_endpoints(o);
  EXPECT_EQ(e.store_addr, "head");
  EXPECT_EQ(e.store_bind, "0.0.0.0");
  EXPECT_EQ(e.store_port, 29500);
  EXPECT_EQ(e.master_addr, "head");
  EXPECT_EQ(e.master_port, 29501);

  o.master_port_given = true;  // an explicit clash is the user's to fix
  EXPECT_THROW(resolve_endpoints(o), InvalidArgument);

  o.standalone = true;
  o.nnodes = 1;
  e = resolve_endpoints(o);
  EXPECT_EQ(e.master_port, 0);
  EXPECT_EQ(e.store_port, 0);
}

TEST(LaunchOptions, Validate) {
  LaunchOptions o;
  o.command = {"prog"};
  EXPECT_NO_THROW(validate(o));
  auto bad = [&](auto change) {
    LaunchOptions c = o;
    change(c);
    EXPECT_THROW(validate(c), InvalidArgument);
  };
  bad([](LaunchOptions& c) { c.command.clear(); });
  bad([](LaunchOptions& c) { c.command = {"--oops"}; });
  bad([](LaunchOptions& c) { c.node_rank = 1; });
  bad([](LaunchOptions& c) { c.rdzv_backend = "etcd"; });
  bad([](LaunchOptions& c) { c.max_restarts = -1; });
  bad([](LaunchOptions& c) { c.standalone = true, c.nnodes = 2; });
  bad([](LaunchOptions& c) { c.tee = parse_std_spec("3:1", "--tee"); });  // local rank 3 of 1 worker
  bad([](LaunchOptions& c) { c.rdzv_endpoint = "h:0"; });
}

TEST(LaunchOptions, WorkerArgvWrapsPythonLikeTorchrun) {
  LaunchOptions o;
  o.command = {"train.py", "--lr", "1"};
  EXPECT_EQ(worker_argv(o, "python3"), (std::vector<std::string>{"python3", "-u", "train.py", "--lr", "1"}));
  o.no_python = true;
  EXPECT_EQ(worker_argv(o, "python3"), (std::vector<std::string>{"train.py", "--lr", "1"}));
  o.no_python = false;
  o.module = true;
  o.command = {"pkg.main"};
  EXPECT_EQ(worker_argv(o, "py"), (std::vector<std::string>{"py", "-u", "-m", "pkg.main"}));
  o.module = false;
  o.command = {"./bin", "x.py"};
  EXPECT_EQ(worker_argv(o, "python3"), (std::vector<std::string>{"./bin", "x.py"}));
}

TEST(LaunchOptions, ResolveProgram) {
  EXPECT_EQ(resolve_program("sh", "/nonexistent:/bin:/usr/bin"), "/bin/sh");
  EXPECT_THROW(resolve_program("sh", "/nonexistent"), InvalidArgument);
  EXPECT_THROW(resolve_program("/nonexistent/prog", "/bin"), InvalidArgument);
  EXPECT_THROW(resolve_program("/tmp", "/bin"), InvalidArgument);  // a directory
}

TEST(WorkerEnv, GlobalRanksOnSecondNode) {
  JobEnv job;
  job.nproc_per_node = 4;
  job.nnodes = 3;
  job.node_rank = 1;
  job.set_omp_threads = true;
  auto vars = worker_env_vars(job, 2);
  std::map<std::string, std::string> m(vars.begin(), vars.end());
  EXPECT_EQ(m["RANK"], "6");
  EXPECT_EQ(m["LOCAL_RANK"], "2");
  EXPECT_EQ(m["WORLD_SIZE"], "12");
  EXPECT_EQ(m["GROUP_RANK"], "1");
  EXPECT_EQ(m["GROUP_WORLD_SIZE"], "3");
  EXPECT_EQ(m["ROLE_RANK"], "6");
  EXPECT_EQ(m["OMP_NUM_THREADS"], "1");
  job.set_omp_threads = false;
  for (const auto& [k, v] : worker_env_vars(job, 0)) EXPECT_NE(k, "OMP_NUM_THREADS");
}

TEST(WorkerEnv, MergeOverridesAndKeeps) {
  std::string a = "PATH=/bin", b = "RANK=old", c = "NOEQUALS";
  char* base[] = {a.data(), b.data(), c.data(), nullptr};
  auto env = merge_environment(base, {{"RANK", "3"}, {"NEW", "x"}});
  EXPECT_EQ(env, (std::vector<std::string>{"PATH=/bin", "RANK=3", "NEW=x"}));
  EXPECT_TRUE(omp_threads_default_needed(nullptr, 2));
  EXPECT_TRUE(omp_threads_default_needed("", 2));
  EXPECT_FALSE(omp_threads_default_needed("8", 2));
  EXPECT_FALSE(omp_threads_default_needed(nullptr, 1));
}

TEST(WorkerEnv, MallocThresholdsUnlessTheUserSetThem) {
  const std::string tuned = malloc_tunables_default(nullptr, nullptr, nullptr, true);
  EXPECT_NE(tuned.find("glibc.malloc.mmap_threshold="), std::string::npos) << tuned;
  EXPECT_NE(tuned.find("glibc.malloc.trim_threshold="), std::string::npos) << tuned;
  EXPECT_EQ(malloc_tunables_default("", "", "", true), tuned) << "empty variables count as unset";
  EXPECT_EQ(malloc_tunables_default("glibc.malloc.arena_max=2", nullptr, nullptr, true), "");
  EXPECT_EQ(malloc_tunables_default(nullptr, "1000000", nullptr, true), "");
  EXPECT_EQ(malloc_tunables_default(nullptr, nullptr, "1000000", true), "");
  EXPECT_EQ(malloc_tunables_default(nullptr, nullptr, nullptr, false), "");

  JobEnv job;
  job.glibc_tunables = tuned;
  std::map<std::string, std::string> m;
  for (const auto& [k, v] : worker_env_vars(job, 0)) m[k] = v;
  EXPECT_EQ(m["GLIBC_TUNABLES"], tuned);
  job.glibc_tunables.clear();
  for (const auto& [k, v] : worker_env_vars(job, 0)) EXPECT_NE(k, "GLIBC_TUNABLES");
}

// The workers learn how many CPUs they share, unless the user said it.
TEST(WorkerEnv, HostCpusFromTheLauncherUnlessTheUserSetThem) {
  EXPECT_EQ(host_cpus_default(nullptr, 2), 2);
  EXPECT_EQ(host_cpus_default("", 16), 16) << "empty counts as unset";
  EXPECT_EQ(host_cpus_default("4", 16), 0) << "the user's COHORT_HOST_CPUS stays";
  JobEnv job;
  job.host_cpus = 6;
  std::map<std::string, std::string> m;
  for (const auto& [k, v] : worker_env_vars(job, 0)) m[k] = v;
  EXPECT_EQ(m["COHORT_HOST_CPUS"], "6");
  job.host_cpus = 0;
  for (const auto& [k, v] : worker_env_vars(job, 0)) EXPECT_NE(k, "COHORT_HOST_CPUS");
}

TEST(Output, PrefixerKeepsPartialLinesWhole) {
  LinePrefixer p("[rank1]: ");
  std::string out;
  p.feed("he", out);
  EXPECT_EQ(out, "");
  p.feed("llo\nwor", out);
  EXPECT_EQ(out, "[rank1]: hello\n");
  p.feed("ld\n\n", out);
  EXPECT_EQ(out, "[rank1]: hello\n[rank1]: world\n[rank1]: \n");
  out.clear();
  p.feed("tail", out);
  p.finish(out);
  EXPECT_EQ(out, "[rank1]: tail\n");
  out.clear();
  p.finish(out);
  EXPECT_EQ(out, "");
}

TEST(Output, PrefixerBoundsLongLines) {
  LinePrefixer p(">", 4);
  std::string out;
  p.feed("abcdef", out);  // no newline in sight: the pending part may not grow past 4 bytes
  EXPECT_EQ(out, ">abcd\n");
  p.feed("g\n", out);
  EXPECT_EQ(out, ">abcd\n>efg\n");
}

// The console thread: a reader that falls behind makes the writer congested
// (and loses nothing, in order); a reader that is gone (EPIPE) makes it drop
// the rest without the SIGPIPE ending this process.
TEST(Output, ConsoleWriterCongestsThenCatchesUpInOrder) {
  int fds[2];
  ASSERT_EQ(pipe2(fds, O_CLOEXEC), 0);
  std::string want;
  {
    ConsoleWriter w(fds[1], 1000);
    for (int i = 0; i < 20000; ++i) {
      std::string line = "line " + std::to_string(i) + "\n";
      want += line;
      w.write(line);  // never blocks, though the pipe holds 64 KiB and nobody reads yet
    }
    EXPECT_TRUE(w.congested());
    EXPECT_FALSE(w.drain(std::chrono::milliseconds(50)));
    std::string got;
    char buf[65536];
    while (got.size() < want.size()) {
      ssize_t n = read(fds[0], buf, sizeof(buf));
      ASSERT_GT(n, 0);
      got.append(buf, static_cast<size_t>(n));
    }
    EXPECT_TRUE(w.drain(std::chrono::seconds(10)));
    EXPECT_FALSE(w.congested());
    EXPECT_EQ(got, want);
  }
  close(fds[0]);
  close(fds[1]);
}

TEST(Output, ConsoleWriterDropsOutputOnceTheReaderIsGone) {
  int fds[2];
  ASSERT_EQ(pipe2(fds, O_CLOEXEC), 0);
  close(fds[0]);
  ConsoleWriter w(fds[1], 1000);
  w.write("nobody reads this\n");
  EXPECT_TRUE(w.drain(std::chrono::seconds(10)));  // EPIPE, not SIGPIPE: we are still here
  for (int i = 0; i < 1000; ++i) w.write("dropped\n");
  EXPECT_TRUE(w.drain(std::chrono::seconds(10)));
  EXPECT_FALSE(w.congested());
  close(fds[1]);
}

TEST(Output, Routes) {
  LaunchOptions o;
  o.nproc_per_node = 2;
  StreamRoute r = route_streams(o, 0);
  EXPECT_TRUE(r.console_out && r.console_err);
  EXPECT_FALSE(r.file_out || r.file_err);
  o.redirects = parse_std_spec("1:2", "--redirects");
  o.tee = parse_std_spec("0:1", "--tee");
  r = route_streams(o, 1);
  EXPECT_TRUE(r.console_out);
  EXPECT_FALSE(r.console_err);
  EXPECT_FALSE(r.file_out);
  EXPECT_TRUE(r.file_err);
  r = route_streams(o, 0);
  EXPECT_TRUE(r.console_out && r.file_out);
  EXPECT_FALSE(r.file_err);
  o.log_dir = "/tmp/x";  // --log-dir: files for every stream
  r = route_streams(o, 0);
  EXPECT_TRUE(r.file_out && r.file_err);
  EXPECT_EQ(worker_log_dir("/l", "job-1", 2, 3), "/l/job-1/attempt_2/3");
}

TEST(RunId, UniqueAndSafe) {
  std::string a = make_cohort_run_id("my job/1"), b = make_cohort_run_id("my job/1");
  EXPECT_NE(a, b);
  EXPECT_EQ(a.rfind("my_job_1-", 0), 0u) << a;
  EXPECT_EQ(make_cohort_run_id("none").rfind("job-", 0), 0u);
  EXPECT_LE(make_cohort_run_id(std::string(100, 'x')).size(), 24u + 1 + 16);
}

TEST(RunId, RemovesOnlyThisJobsSegments) {
  namespace fs = std::filesystem;
  std::string dir = (fs::temp_directory_path() / "cohort_shm_test_XXXXXX").string();
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  for (const char* name : {"cohort-j-1-a", "cohort-j-1-b", "cohort-j-10-a", "cohort-k-1-a", "other"})
    std::ofstream(dir + "/" + name) << "x";
  EXPECT_EQ(remove_shm_segments("j-1", dir), 2);
  EXPECT_FALSE(fs::exists(dir + "/cohort-j-1-a"));
  EXPECT_TRUE(fs::exists(dir + "/cohort-j-10-a"));
  EXPECT_TRUE(fs::exists(dir + "/cohort-k-1-a"));
  EXPECT_TRUE(fs::exists(dir + "/other"));
  EXPECT_EQ(remove_shm_segments("j-1", dir + "/missing"), 0);
  fs::remove_all(dir);
}
