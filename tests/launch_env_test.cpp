// read_launch_env and Slurm's list parsers (pure functions, hit directly), and
// real jobs: place_worker started by mpirun, and by hand with the variables
// srun sets, finds its place without `cohort run` and completes an allreduce.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "cohort/cohort.hpp"
#include "group/launch_env.hpp"
#include "proc_util.hpp"
#include "test_deps.hpp"

namespace cohort {
namespace {

using group::EnvMap;
using group::expand_hostlist;
using group::expand_tasks_per_node;
using group::first_host;
using group::read_launch_env;

// The InvalidArgument message of f(), or "" when it did not throw one.
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_INVALID(expr, ...)                                      \
  do {                                                                 \
    std::string msg = error_of([&] { (void)(expr); });                 \
    ASSERT_FALSE(msg.empty()) << #expr << " did not throw";            \
    for (const char* part : {__VA_ARGS__}) EXPECT_NE(msg.find(part), std::string::npos) << msg; \
  } while (0)

// ---- torchrun and cohort run ----

TEST(LaunchEnv, Torchrun) {
  auto le = read_launch_env({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
                             {"MASTER_ADDR", "10.0.0.5"}, {"MASTER_PORT", "1234"}});
  EXPECT_EQ(le.source, "torchrun");
  EXPECT_EQ(le.rank, 3);
  EXPECT_EQ(le.world_size, 8);
  EXPECT_EQ(le.local_rank, 1);
  EXPECT_EQ(le.local_world_size, 2);
  EXPECT_EQ(le.master_addr, "10.0.0.5");
  EXPECT_EQ(le.master_addr_from, "MASTER_ADDR");
  EXPECT_EQ(le.master_port, 1234);
  EXPECT_FALSE(le.launcher_store);
}

TEST(LaunchEnv, RankAndSizeByHandDefaultToOneHostAndPort29500) {
  auto le = read_launch_env({{"RANK", "1"}, {"WORLD_SIZE", "2"}});
  EXPECT_EQ(le.source, "torchrun");
  EXPECT_EQ(le.master_addr, "127.0.0.1");
  EXPECT_EQ(le.master_port, 29500);
  EXPECT_FALSE(le.local_rank.has_value());
}

TEST(LaunchEnv, CohortRunStoreIsServedByTheAgent) {
  auto le = read_launch_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h0"}, {"MASTER_PORT", "29500"},
                             {"COHORT_STORE_ADDR", "h1"}, {"COHORT_STORE_PORT", "29501"}});
  EXPECT_EQ(le.source, "cohort run");
  EXPECT_TRUE(le.launcher_store);
  EXPECT_EQ(le.master_addr, "h1");
  EXPECT_EQ(le.master_port, 29501);
  EXPECT_INVALID(read_launch_env({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"COHORT_STORE_ADDR", "h1"}}),
                 "COHORT_STORE_PORT");
}

TEST(LaunchEnv, TorchrunWinsOverMpiAndSlurm) {
  auto le = read_launch_env({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "0"},
                             {"OMPI_COMM_WORLD_SIZE", "4"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}});
  EXPECT_EQ(le.source, "torchrun");
  EXPECT_EQ(le.rank, 1);
}

TEST(LaunchEnv, ContradictionsNameTheVariables) {
  EXPECT_INVALID(read_launch_env({{"RANK", "0"}}), "RANK", "WORLD_SIZE");
  EXPECT_INVALID(read_launch_env({{"WORLD_SIZE", "2"}}), "RANK", "WORLD_SIZE");
  EXPECT_INVALID(read_launch_env({{"RANK", "2"}, {"WORLD_SIZE", "2"}}), "RANK=2", "WORLD_SIZE=2");
  EXPECT_INVALID(read_launch_env({{"RANK", "0"}, {"WORLD_SIZE", "0"}}), "WORLD_SIZE=0");
  EXPECT_INVALID(read_launch_env({{"RANK", "x"}, {"WORLD_SIZE", "2"}}), "RANK='x'");
  EXPECT_INVALID(read_launch_env({{"RANK", "-1"}, {"WORLD_SIZE", "2"}}), "RANK='-1'");
  EXPECT_INVALID(read_launch_env({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}}),
                 "LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2");
  EXPECT_INVALID(read_launch_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "3"}}), "LOCAL_WORLD_SIZE=3");
  EXPECT_INVALID(read_launch_env({{"OMPI_COMM_WORLD_RANK", "0"}}), "OMPI_COMM_WORLD_SIZE");
  EXPECT_INVALID(read_launch_env({{"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_SIZE", "4"}}),
                 "OMPI_COMM_WORLD_RANK=5", "OMPI_COMM_WORLD_SIZE=4", "Open MPI");
  EXPECT_INVALID(read_launch_env({{"SLURM_PROCID", "0"}}), "SLURM_PROCID", "SLURM_NTASKS");
  EXPECT_INVALID(read_launch_env({{"PMI_SIZE", "2"}}), "PMI_RANK");
}

TEST(LaunchEnv, NothingSetSaysHowToStart) {
  EXPECT_INVALID(read_launch_env({{"HOME", "/root"}}), "RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "mpirun");
}

TEST(LaunchEnv, BadPorts) {
  EXPECT_INVALID(read_launch_env({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "0"}}), "MASTER_PORT=0");
  EXPECT_INVALID(read_launch_env({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "70000"}}), "MASTER_PORT");
  EXPECT_INVALID(read_launch_env({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "http"}}), "MASTER_PORT");
}

TEST(LaunchEnv, GivenRankAndSizeIgnoreTheLaunchersVariables) {
  auto le = read_launch_env({{"RANK", "7"}}, 1, 2);  // RANK alone would be an error
  EXPECT_EQ(le.source, "InitOptions");
  EXPECT_EQ(le.rank, 1);
  EXPECT_EQ(le.world_size, 2);
  auto one = read_launch_env({{"WORLD_SIZE", "4"}}, 3, std::nullopt);
  EXPECT_EQ(one.rank, 3);
  EXPECT_EQ(one.world_size, 4);
  EXPECT_INVALID(read_launch_env({}, 2, 2), "InitOptions::rank=2");
}

// ---- Open MPI ----

EnvMap ompi(int rank, int size, int local_rank, int local_size) {
  return {{"OMPI_COMM_WORLD_RANK", std::to_string(rank)}, {"OMPI_COMM_WORLD_SIZE", std::to_string(size)},
          {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(local_rank)},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", std::to_string(local_size)}};
}

TEST(LaunchEnv, OpenMpiOneHost) {
  auto le = read_launch_env(ompi(1, 2, 1, 2));
  EXPECT_EQ(le.source, "Open MPI");
  EXPECT_EQ(le.rank, 1);
  EXPECT_EQ(le.world_size, 2);
  EXPECT_EQ(le.local_rank, 1);
  EXPECT_EQ(le.local_world_size, 2);
  EXPECT_EQ(le.master_addr, "127.0.0.1");
  EXPECT_EQ(le.master_addr_from, "single host");
  EXPECT_EQ(le.master_port, 29500);
}

TEST(LaunchEnv, OpenMpiManyHostsNeedsMasterAddr) {
  EXPECT_INVALID(read_launch_env(ompi(3, 4, 1, 2)), "Open MPI", "MASTER_ADDR", "mpirun -x MASTER_ADDR",
                 "2 of its 4 ranks");
  EnvMap env = ompi(3, 4, 1, 2);
  env["MASTER_ADDR"] = "node7";
  env["MASTER_PORT"] = "40000";
  auto le = read_launch_env(env);
  EXPECT_EQ(le.master_addr, "node7");
  EXPECT_EQ(le.master_port, 40000);
}

TEST(LaunchEnv, OpenMpiInsideASlurmJobIgnoresTheBatchStepsVariables) {
  // mpirun in an sbatch script: every rank inherits SLURM_PROCID=0.
  EnvMap env = ompi(3, 4, 1, 2);
  env.insert({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "0"}, {"SLURM_JOB_NODELIST", "n[3-4]"}});
  auto le = read_launch_env(env);
  EXPECT_EQ(le.source, "Open MPI");
  EXPECT_EQ(le.rank, 3);
  EXPECT_EQ(le.local_rank, 1);
  EXPECT_EQ(le.master_addr, "n3");  // rank 0 runs on the allocation's first node
  EXPECT_EQ(le.master_addr_from, "first host of SLURM_JOB_NODELIST");
}

// ---- PMI / PMIx ----

TEST(LaunchEnv, HydraPmi) {
  auto le = read_launch_env({{"PMI_RANK", "2"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "2"}, {"MPI_LOCALNRANKS", "4"}});
  EXPECT_EQ(le.source, "PMI/PMIx (MPICH, Intel MPI)");
  EXPECT_EQ(le.rank, 2);
  EXPECT_EQ(le.local_world_size, 4);
  EXPECT_EQ(le.master_addr, "127.0.0.1");
}

TEST(LaunchEnv, PmiWinsOverSlurm) {
  auto le = read_launch_env({{"PMI_RANK", "2"}, {"PMI_SIZE", "4"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"},
                             {"MASTER_ADDR", "h0"}});
  EXPECT_EQ(le.source, "PMI/PMIx (MPICH, Intel MPI)");
  EXPECT_EQ(le.rank, 2);
}

TEST(LaunchEnv, Pmix) {
  auto le = read_launch_env({{"PMIX_RANK", "1"}, {"PMI_SIZE", "2"}, {"MASTER_ADDR", "h0"}});
  EXPECT_EQ(le.source, "PMI/PMIx (MPICH, Intel MPI)");
  EXPECT_EQ(le.rank, 1);
  EXPECT_EQ(le.world_size, 2);
  EXPECT_INVALID(read_launch_env({{"PMIX_RANK", "1"}}), "PMIX_RANK", "PMI_SIZE");
  // srun --mpi=pmix sets both PMIx's and Slurm's variables: Slurm's are complete.
  auto srun = read_launch_env({{"PMIX_RANK", "1"}, {"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"},
                               {"SLURM_LOCALID", "1"}, {"SLURM_TASKS_PER_NODE", "2"}});
  EXPECT_EQ(srun.source, "Slurm");
  EXPECT_EQ(srun.local_world_size, 2);
}

// ---- Slurm ----

TEST(LaunchEnv, SlurmManyNodes) {
  // srun -N4 -n7: 2 tasks on each of three nodes, 1 on the last; this is task 6 on node 3.
  auto le = read_launch_env({{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "7"}, {"SLURM_LOCALID", "0"},
                             {"SLURM_NODEID", "3"}, {"SLURM_TASKS_PER_NODE", "2(x3),1"},
                             {"SLURM_JOB_NODELIST", "node[01-03,07]"}});
  EXPECT_EQ(le.source, "Slurm");
  EXPECT_EQ(le.rank, 6);
  EXPECT_EQ(le.world_size, 7);
  EXPECT_EQ(le.local_rank, 0);
  EXPECT_EQ(le.local_world_size, 1);
  EXPECT_EQ(le.master_addr, "node01");
  EXPECT_EQ(le.master_port, 29500);
}

TEST(LaunchEnv, SlurmPrefersTheStepsNodeListAndMasterAddr) {
  EnvMap env{{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_NTASKS_PER_NODE", "1"},
             {"SLURM_JOB_NODELIST", "a[1-9]"}, {"SLURM_STEP_NODELIST", "a[4-5]"}};
  auto le = read_launch_env(env);
  EXPECT_EQ(le.local_world_size, 1);
  EXPECT_EQ(le.master_addr, "a4");
  EXPECT_EQ(le.master_addr_from, "first host of SLURM_STEP_NODELIST");
  env["MASTER_ADDR"] = "a9";
  EXPECT_EQ(read_launch_env(env).master_addr, "a9");
}

TEST(LaunchEnv, SlurmOneNodeAndOldNames) {
  auto le = read_launch_env({{"SLURM_PROCID", "1"}, {"SLURM_NPROCS", "2"}, {"SLURM_LOCALID", "1"},
                             {"SLURM_TASKS_PER_NODE", "2"}, {"SLURM_NODELIST", "gpu5"}});
  EXPECT_EQ(le.world_size, 2);
  EXPECT_EQ(le.local_world_size, 2);
  EXPECT_EQ(le.master_addr, "127.0.0.1");
}

TEST(LaunchEnv, SlurmWithoutNodeListOrMasterAddr) {
  EXPECT_INVALID(read_launch_env({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}, {"SLURM_TASKS_PER_NODE", "2(x2)"}}),
                 "Slurm", "MASTER_ADDR");
  EXPECT_INVALID(read_launch_env({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}, {"SLURM_TASKS_PER_NODE", "2(x"},
                                  {"SLURM_JOB_NODELIST", "n1"}}),
                 "SLURM_TASKS_PER_NODE='2(x'");
  EXPECT_INVALID(read_launch_env({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}, {"SLURM_NTASKS_PER_NODE", "2"},
                                  {"SLURM_JOB_NODELIST", "n[1-"}}),
                 "SLURM_JOB_NODELIST='n[1-'", "MASTER_ADDR");
}

// ---- Slurm's list formats ----

TEST(SlurmLists, HostLists) {
  using V = std::vector<std::string>;
  EXPECT_EQ(expand_hostlist("gpu5"), V{"gpu5"});
  EXPECT_EQ(expand_hostlist("node[01-04,07],gpu5"), (V{"node01", "node02", "node03", "node04", "node07", "gpu5"}));
  EXPECT_EQ(expand_hostlist("n[8-10]"), (V{"n8", "n9", "n10"}));
  EXPECT_EQ(expand_hostlist("n[08-10]"), (V{"n08", "n09", "n10"}));
  EXPECT_EQ(expand_hostlist("r[1-2]n[1-2]"), (V{"r1n1", "r1n2", "r2n1", "r2n2"}));
  EXPECT_EQ(expand_hostlist("a,b[3],c-d[0-1].x"), (V{"a", "b3", "c-d0.x", "c-d1.x"}));
  EXPECT_EQ(expand_hostlist("127.0.0.[1-2]"), (V{"127.0.0.1", "127.0.0.2"}));
}

TEST(SlurmLists, FirstHost) {
  EXPECT_EQ(first_host("node[01-04,07],gpu5"), "node01");
  EXPECT_EQ(first_host("gpu5,node[01-04]"), "gpu5");
  EXPECT_EQ(first_host("r[3-4]n[007,1]"), "r3n007");
  EXPECT_EQ(first_host("x[0-999999999]"), "x0");  // not expanded
}

TEST(SlurmLists, MalformedHostLists) {
  for (const char* bad : {"", "node[01-", "node[a-b]", "node[4-2]", "a,,b", "a,", "a]", "n[1,]", "n[[1]]", "a b"})
    EXPECT_INVALID(expand_hostlist(bad, "SLURM_NODELIST"), "SLURM_NODELIST");
  EXPECT_INVALID(expand_hostlist("x[0-9999999]"), "more than");
}

TEST(SlurmLists, TasksPerNode) {
  using V = std::vector<int>;
  EXPECT_EQ(expand_tasks_per_node("4"), V{4});
  EXPECT_EQ(expand_tasks_per_node("2(x3),1"), (V{2, 2, 2, 1}));
  EXPECT_EQ(expand_tasks_per_node("1,3(x2)"), (V{1, 3, 3}));
  for (const char* bad : {"", "0", "x", "2(x", "2(3)", "2(x0)", "2,,1", "-1"})
    EXPECT_INVALID(expand_tasks_per_node(bad), "SLURM_TASKS_PER_NODE");
}

// ---- real jobs ----

// Tests must not inherit a launcher's variables (say, ctest run inside srun).
void clear_launcher_env() {
  std::vector<std::string> names;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv(*e);
    std::string name = kv.substr(0, kv.find('='));
    for (const char* prefix : {"OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI_LOCAL", "COHORT_STORE_"})
      if (name.rfind(prefix, 0) == 0) names.push_back(name);
    for (const char* exact : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
      if (name == exact) names.push_back(name);
  }
  for (auto& n : names) unsetenv(n.c_str());
}

std::string find_in_path(const std::string& prog) {
  const char* path = std::getenv("PATH");
  std::string p = path != nullptr ? path : "/usr/bin:/bin";
  size_t start = 0;
  while (start <= p.size()) {
    size_t colon = p.find(':', start);
    std::string dir = p.substr(start, colon == std::string::npos ? std::string::npos : colon - start);
    std::string full = (dir.empty() ? "." : dir) + "/" + prog;
    if (access(full.c_str(), X_OK) == 0) return full;
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  return "";
}

const std::string kWorker = std::string(COHORT_TEST_BIN_DIR) + "/place_worker";

size_t count_of(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

TEST(LaunchEnvJob, MpirunTwoRanks) {
  const std::string mpirun = find_in_path("mpirun");
  if (mpirun.empty()) COHORT_MISSING_DEP("mpirun not found in PATH (apt-get install openmpi-bin): skipping the mpirun job");
  clear_launcher_env();
  const std::string port = std::to_string(testing::free_port());
  std::vector<testing::Proc> ps{testing::spawn(
      {mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "MASTER_PORT", "-x", "COHORT_TIMEOUT",
       kWorker},
      {{"MASTER_PORT", port}, {"COHORT_TIMEOUT", "60s"}}, ::testing::TempDir() + "launch_env_mpirun")};
  ASSERT_TRUE(testing::wait_all(ps, std::chrono::seconds(120))) << "mpirun hung; stderr:\n" << ps[0].err();
  const std::string out = ps[0].out();
  EXPECT_EQ(ps[0].exit_code(), 0) << "stdout:\n" << out << "\nstderr:\n" << ps[0].err();
  EXPECT_EQ(count_of(out, "allreduce ok"), 2u) << out;
  EXPECT_EQ(count_of(out, "size=2 local_rank="), 2u) << out;
  EXPECT_EQ(count_of(out, "local_size=2 source=Open MPI addr=127.0.0.1"), 2u) << out;
  EXPECT_NE(out.find("place rank=0 "), std::string::npos) << out;
  EXPECT_NE(out.find("place rank=1 "), std::string::npos) << out;
}

// Two processes with the variables srun sets for each task, no torchrun's.
void run_slurm_like(bool one_node) {
  clear_launcher_env();
  const std::string port = std::to_string(testing::free_port());
  std::vector<testing::Proc> ps;
  for (int r = 0; r < 2; ++r) {
    std::map<std::string, std::string> env{
        {"SLURM_JOB_ID", "4242"},          {"SLURM_STEP_ID", "0"},
        {"SLURM_PROCID", std::to_string(r)}, {"SLURM_NTASKS", "2"},
        {"MASTER_PORT", port},             {"COHORT_TIMEOUT", "60s"}};
    if (one_node) {  // srun -N1 -n2
      env.insert({{"SLURM_LOCALID", std::to_string(r)}, {"SLURM_NODEID", "0"}, {"SLURM_TASKS_PER_NODE", "2"},
                  {"SLURM_JOB_NODELIST", "localhost"}});
    } else {  // srun -N2 -n2 on two "nodes" that are loopback addresses of this host
      env.insert({{"SLURM_LOCALID", "0"}, {"SLURM_NODEID", std::to_string(r)}, {"SLURM_TASKS_PER_NODE", "1(x2)"},
                  {"SLURM_JOB_NODELIST", "127.0.0.[1-2]"}});
    }
    // Output files of their own: ctest -j runs the one-node and two-node
    // variants at once, and shared names let one truncate the other's.
    ps.push_back(testing::spawn({kWorker}, env,
                                ::testing::TempDir() + "launch_env_slurm" + (one_node ? "1n." : "2n.") +
                                    std::to_string(::getpid()) + "." + std::to_string(r)));
  }
  ASSERT_TRUE(testing::wait_all(ps, std::chrono::seconds(120))) << "ranks hung; rank 0 stderr:\n" << ps[0].err();
  for (int r = 0; r < 2; ++r) {
    const std::string out = ps[r].out();
    EXPECT_EQ(ps[r].exit_code(), 0) << "rank " << r << " stderr:\n" << ps[r].err();
    EXPECT_NE(out.find("place rank=" + std::to_string(r) + " size=2"), std::string::npos) << out;
    EXPECT_NE(out.find("source=Slurm addr=127.0.0.1: allreduce ok"), std::string::npos) << out;
    EXPECT_NE(out.find(one_node ? "local_size=2" : "local_size=1"), std::string::npos) << out;
  }
}

TEST(LaunchEnvJob, SlurmLikeOneNode) { run_slurm_like(true); }
TEST(LaunchEnvJob, SlurmLikeTwoNodesFromTheNodeList) { run_slurm_like(false); }

}  // namespace
}  // namespace cohort
