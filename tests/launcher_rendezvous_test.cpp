// The static rendezvous protocol (src/launch/rendezvous.hpp) over a
// MemoryStore, with launchers played by threads: joins, mismatches, duplicate
// node ranks, timeouts naming the missing nodes, failures and finishing.
#include <gtest/gtest.h>

#include <thread>

#include "cohort/error.hpp"
#include "cohort/store.hpp"
#include "launch/process.hpp"
#include "launch/rendezvous.hpp"

using namespace cohort;
using namespace cohort::launch;
using namespace std::chrono_literals;

namespace {

RendezvousOptions node(int rank, int nnodes, int nproc = 2) {
  RendezvousOptions o;
  o.run_id = "t";
  o.nnodes = nnodes;
  o.node_rank = rank;
  o.nproc_per_node = nproc;
  o.host = "host" + std::to_string(rank);
  o.join_timeout = 20s;
  o.finish_timeout = 20s;
  o.leave_timeout = 5s;
  o.poll = 10ms;
  return o;
}

class Rendezvous : public ::testing::Test {
 protected:
  SignalChannel signals_;  // first, so the threads below inherit the blocked mask
  MemoryStore store_;
};

TEST_F(Rendezvous, AllNodesJoinAndShareTheRunId) {
  std::vector<std::vector<NodeInfo>> seen(3);
  std::vector<std::string> ids = {"job-0000", "", ""};
  std::vector<std::thread> threads;
  for (int r = 2; r >= 0; --r)  // node 0 last: the others wait for it
    threads.emplace_back([&, r] {
      StaticRendezvous rdzv(store_, node(r, 3), signals_);
      seen[r] = rdzv.join(0, ids[r]);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(seen[r].size(), 3u);
    EXPECT_EQ(ids[r], "job-0000");
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(seen[r][i].node_rank, i);
      EXPECT_EQ(seen[r][i].host, "host" + std::to_string(i));
      EXPECT_EQ(seen[r][i].nproc_per_node, 2);
    }
  }
}

TEST_F(Rendezvous, MismatchedNprocIsRefused) {
  std::string id = "x";
  std::thread other([&] {
    StaticRendezvous rdzv(store_, node(1, 2, 4), signals_);
    std::string mine;
    EXPECT_THROW(rdzv.join(0, mine), InvalidArgument);
  });
  StaticRendezvous rdzv(store_, node(0, 2, 2), signals_);
  EXPECT_THROW(rdzv.join(0, id), InvalidArgument);
  other.join();
}

TEST_F(Rendezvous, DuplicateNodeRankIsRefused) {
  auto opts = node(1, 3);
  opts.join_timeout = 200ms;
  StaticRendezvous first(store_, opts, signals_), second(store_, opts, signals_);
  std::string id;
  EXPECT_THROW(first.join(0, id), TimeoutError);  // registered, then waited in vain
  try {
    second.join(0, id);
    FAIL() << "a second node 1 joined";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("node rank 1 is already taken by the launcher on host1"), std::string::npos)
        << e.what();
  }
}

TEST_F(Rendezvous, TimeoutNamesTheMissingNodes) {
  auto opts = node(0, 4);
  opts.join_timeout = 100ms;
  StaticRendezvous rdzv(store_, opts, signals_);
  std::string id = "x";
  try {
    rdzv.join(0, id);
    FAIL();
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("node(s) 1, 2, 3 did not join"), std::string::npos) << e.what();
  }
}

TEST_F(Rendezvous, FirstFailureWinsAndFinishSeesIt) {
  StaticRendezvous a(store_, node(0, 2), signals_), b(store_, node(1, 2), signals_);
  EXPECT_FALSE(a.failure(0).has_value());
  b.publish_failure(0, {"rank 3 exited with code 3", false});
  a.publish_failure(0, {"rank 0 exited with code 1", true});
  auto f = a.failure(0);
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->what, "rank 3 exited with code 3");
  EXPECT_FALSE(f->final);
  EXPECT_FALSE(a.failure(1).has_value()) << "failures belong to one attempt";
  auto done = a.finish(0);
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->what, "rank 3 exited with code 3");
}

TEST_F(Rendezvous, FinishWaitsForEveryNode) {
  std::optional<RemoteFailure> r0, r1;
  std::thread late([&] {
    std::this_thread::sleep_for(50ms);
    StaticRendezvous b(store_, node(1, 2), signals_);
    r1 = b.finish(0);
  });
  StaticRendezvous a(store_, node(0, 2), signals_);
  r0 = a.finish(0);
  late.join();
  EXPECT_FALSE(r0.has_value());
  EXPECT_FALSE(r1.has_value());
}

TEST_F(Rendezvous, FinalFailureAbortsAWaitingJoin) {
  StaticRendezvous a(store_, node(0, 3), signals_);
  std::thread stopper([&] {
    std::this_thread::sleep_for(50ms);
    StaticRendezvous c(store_, node(2, 3), signals_);
    c.publish_failure(0, {"the launcher of node 2 (host2) was stopped by SIGTERM", true});
  });
  std::string id = "x";
  EXPECT_THROW(a.join(0, id), PeerError);
  stopper.join();
}

}  // namespace
