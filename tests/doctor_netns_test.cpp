// `cohort doctor` across two "hosts": two network namespaces joined by a veth
// pair (10.82.0.1 and 10.82.0.2), one `cohort run` launcher in each. Needs root
// and `ip netns`; skips otherwise. The namespaces are private to the test, so
// the fixed ports below cannot collide with anything.
//
// Unreachable case: node 1 advertises an address of a second interface in its
// namespace that the other namespace cannot reach (ARP for it goes unanswered:
// arp_ignore=1), so node 0's probe really fails, as with a misconfigured
// COHORT_SOCKET_IFNAME on a real cluster.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "launch_harness.hpp"

namespace lt = launch_test;

namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

bool sh(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()) == 0; }

class DoctorNetns : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root for network namespaces";
    const std::string id = std::to_string(getpid());
    ns_[0] = "coh_dd_a" + id;
    ns_[1] = "coh_dd_b" + id;
    const std::string va = "vdda" + id, vb = "vddb" + id;
    if (!sh("ip netns add " + ns_[0]) || !sh("ip netns add " + ns_[1])) {
      cleanup();
      GTEST_SKIP() << "cannot create network namespaces (ip netns add failed)";
    }
    created_ = true;
    bool ok = sh("ip link add " + va + " type veth peer name " + vb) && sh("ip link set " + va + " netns " + ns_[0]) &&
              sh("ip link set " + vb + " netns " + ns_[1]);
    for (int i = 0; i < 2 && ok; ++i) {
      const std::string dev = i == 0 ? va : vb;
      ok = sh("ip -n " + ns_[i] + " addr add 10.82.0." + std::to_string(i + 1) + "/24 dev " + dev) &&
           sh("ip -n " + ns_[i] + " link set " + dev + " up") && sh("ip -n " + ns_[i] + " link set lo up");
    }
    if (!ok) GTEST_SKIP() << "cannot set up the veth pair between the namespaces";
    dir_ = lt::temp_dir();
  }
  void TearDown() override { cleanup(); }

  void cleanup() {
    for (const auto& n : ns_)
      if (!n.empty()) sh("ip netns del " + n);
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  // Runs one launcher per namespace (both at once) and waits for both.
  void run_nodes(const std::string& program, const std::string& node1_env = "") {
    std::string cmd = "(";
    for (int node = 0; node < 2; ++node) {
      std::string env = "COHORT_RDZV_TIMEOUT=60s COHORT_TERM_TIMEOUT=2s COHORT_DOCTOR_CONNECT_TIMEOUT=3s ";
      if (node == 1) env += node1_env + " ";
      std::string d = dir_ + "/" + std::to_string(node);
      cmd += "(ip netns exec " + ns_[node] + " env " + env + "timeout 150 " + COHORT_BIN +
             " run --nnodes 2 --node-rank " + std::to_string(node) +
             " --nproc-per-node 1 --master-addr 10.82.0.1 --master-port 29500 " + program + " >" + d + ".out 2>" + d +
             ".err; echo $? >" + d + ".rc) & ";
    }
    cmd += "wait)";
    std::system(cmd.c_str());
    for (int node = 0; node < 2; ++node) {
      std::string d = dir_ + "/" + std::to_string(node);
      out_[node] = slurp(d + ".out");
      err_[node] = slurp(d + ".err");
      rc_[node] = std::atoi(slurp(d + ".rc").c_str());
      if (std::getenv("COHORT_TEST_SHOW") != nullptr)  // to look at the output of a passing run
        std::printf("--- node %d, exit %d\n%s%s", node, rc_[node], out_[node].c_str(), err_[node].c_str());
    }
  }

  std::string ns_[2], dir_;
  bool created_ = false;
  std::string out_[2], err_[2];
  int rc_[2] = {-1, -1};
};

}  // namespace

TEST_F(DoctorNetns, TwoHostsAreHealthyAndMeasuredOverTcp) {
  run_nodes(std::string(COHORT_BIN) + " doctor --bytes 256K --iters 2 --timeout 60");
  EXPECT_EQ(rc_[0], 0) << out_[0] << err_[0];
  EXPECT_EQ(rc_[1], 0) << out_[1] << err_[1];
  EXPECT_TRUE(contains(out_[0], "[rank0]: cohort doctor: 2 rank(s) on 2 host(s)")) << out_[0];
  EXPECT_TRUE(contains(out_[0], "other host: rank 0 <-> rank 1 over tcp")) << out_[0];
  EXPECT_TRUE(contains(out_[0], "clock skew: ok")) << out_[0];
  EXPECT_TRUE(contains(out_[0], "verdict: HEALTHY")) << out_[0];
}

TEST_F(DoctorNetns, UnreachableAddressIsNamedAndPreflightRefuses) {
  // A second interface in node 1's namespace (one end of a veth pair that
  // stays inside it) whose address node 0 cannot reach.
  const std::string side = "vddc" + std::to_string(getpid()), other = "vddd" + std::to_string(getpid());
  ASSERT_TRUE(sh("ip -n " + ns_[1] + " link add " + side + " type veth peer name " + other) &&
              sh("ip -n " + ns_[1] + " addr add 10.82.0.102/32 dev " + side) &&
              sh("ip -n " + ns_[1] + " link set " + side + " up") &&
              sh("ip netns exec " + ns_[1] + " sysctl -w net.ipv4.conf.all.arp_ignore=1"));
  const std::string marker = dir_ + "/started";
  run_nodes("--preflight /bin/sh -c 'touch " + marker + ".$RANK'", "COHORT_SOCKET_IFNAME==" + side);
  EXPECT_EQ(rc_[0], 1) << out_[0] << err_[0];
  EXPECT_EQ(rc_[1], 1) << out_[1] << err_[1];
  EXPECT_TRUE(contains(out_[0], "PROBLEM: rank 0 on host ")) << out_[0];
  EXPECT_TRUE(contains(out_[0], "cannot reach rank 1 on host ")) << out_[0];
  EXPECT_TRUE(contains(out_[0], "at 10.82.0.102:")) << out_[0];
  EXPECT_TRUE(contains(out_[0], "COHORT_SOCKET_IFNAME")) << out_[0];
  EXPECT_TRUE(contains(out_[0], "verdict: UNHEALTHY")) << out_[0];
  EXPECT_TRUE(contains(err_[0], "refusing to start /bin/sh")) << err_[0];
  EXPECT_FALSE(std::filesystem::exists(marker + ".0") || std::filesystem::exists(marker + ".1"))
      << "the program ran although the pre-flight check failed";
}
