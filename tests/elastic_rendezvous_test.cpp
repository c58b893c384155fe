// The dynamic (c10d) rendezvous of `cohort run --rdzv-backend c10d`, with
// launchers played by threads over one MemoryStore: rank assignment in any
// start order, MIN:MAX with the last-call window, late arrivals waiting for the
// next round, too few nodes, mismatched flags; and the liveness bookkeeping.
#include "launch/elastic_rendezvous.hpp"

#include <gtest/gtest.h>

#include <future>
#include <set>
#include <thread>

#include "cohort/error.hpp"
#include "cohort/store.hpp"
#include "launch/liveness.hpp"
#include "launch/options.hpp"
#include "launch/worker_env.hpp"

using namespace cohort;
using namespace cohort::launch;
using namespace std::chrono_literals;

namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

ElasticOptions options(int min_nodes, int max_nodes, int nproc, const std::string& host) {
  ElasticOptions o;
  o.run_id = "unit";
  o.min_nodes = min_nodes;
  o.max_nodes = max_nodes;
  o.nproc_per_node = nproc;
  o.host = host;
  o.last_call = 300ms;
  o.join_timeout = 20s;
  o.finish_timeout = 20s;
  o.poll = 20ms;
  return o;
}

// One launcher: its own rendezvous object on the shared store.
struct Launcher {
  Launcher(Store& store, ElasticOptions o, SignalChannel& signals) : rdzv(store, std::move(o), signals) {
    agent = rdzv.register_agent();
  }
  Round join(int min_round = 0) {
    return rdzv.join(agent, min_round, [this] {
      return std::pair<std::string, int>("10.0.0." + std::to_string(agent), 4000 + static_cast<int>(agent));
    });
  }
  ElasticRendezvous rdzv;
  long agent = 0;
};

class ElasticRendezvousTest : public ::testing::Test {
 protected:
  MemoryStore store;
  SignalChannel signals;
};

}  // namespace

TEST(ElasticRanks, PrefixSumsOfDifferentNproc) {
  std::vector<RoundNode> nodes(3);
  nodes[0].nproc = 2;
  nodes[1].nproc = 1;
  nodes[2].nproc = 3;
  int world = 0;
  assign_ranks(nodes, world);
  EXPECT_EQ(world, 6);
  EXPECT_EQ(nodes[0].rank_base, 0);
  EXPECT_EQ(nodes[1].rank_base, 2);
  EXPECT_EQ(nodes[2].rank_base, 3);
  EXPECT_EQ(nodes[2].node_rank, 2);
}

TEST(ElasticOptions, MinMaxNeedsTheC10dBackend) {
  LaunchOptions o;
  o.command = {"true"};
  o.nnodes = 3;
  o.min_nnodes = 1;
  try {
    validate(o);
    FAIL() << "MIN < MAX with the static backend must be refused";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(contains(e.what(), "--nnodes 1:3: elastic membership (MIN < MAX) needs the dynamic rendezvous"))
        << e.what();
    EXPECT_TRUE(contains(e.what(), "--rdzv-backend c10d")) << e.what();
  }
  o.rdzv_backend = "c10d";
  o.node_rank = 7;  // ignored: c10d assigns node ranks
  EXPECT_NO_THROW(validate(o));
  EXPECT_TRUE(is_elastic(o));
  o.nnodes = 1;
  o.min_nnodes = 1;
  EXPECT_FALSE(is_elastic(o)) << "one node runs the plain single-node launcher";
}

TEST(ElasticOptions, WorkerRanksComeFromTheRound) {
  JobEnv env;
  env.nproc_per_node = 2;  // this node runs 2 workers; the round has 5 in all
  env.nnodes = 2;
  env.node_rank = 1;
  env.rank_base = 3;
  env.world_size = 5;
  EnvVars v = worker_env_vars(env, 1);
  auto get = [&](const std::string& k) {
    for (const auto& [name, value] : v)
      if (name == k) return value;
    return std::string("<unset>");
  };
  EXPECT_EQ(get("RANK"), "4");
  EXPECT_EQ(get("WORLD_SIZE"), "5");
  EXPECT_EQ(get("LOCAL_WORLD_SIZE"), "2");
  EXPECT_EQ(get("GROUP_RANK"), "1");
  EXPECT_EQ(get("ROLE_RANK"), "4");
}

TEST(Liveness, SilentCounterIsLostByTheObserversClock) {
  LivenessTracker t(1000ms);
  auto t0 = core::Clock::now();
  t.observe(1, 5, t0);
  t.observe(2, 7, t0);
  t.observe(1, 6, t0 + 600ms);  // agent 1 beats, agent 2 does not
  EXPECT_TRUE(t.lost(t0 + 900ms).empty());
  EXPECT_EQ(t.lost(t0 + 1000ms), std::vector<long>{2});
  EXPECT_EQ(t.lost(t0 + 1600ms), (std::vector<long>{1, 2}));
  EXPECT_DOUBLE_EQ(t.silent_for(2, t0 + 1500ms), 1.5);
  t.forget(2);
  EXPECT_EQ(t.lost(t0 + 1500ms), std::vector<long>{});
}

TEST(Liveness, HeartbeatThreadBumpsItsKey) {
  auto store = std::make_shared<MemoryStore>();
  {
    Heartbeat hb(store, heartbeat_key("p/", 3), 10ms);
    EXPECT_GE(store->add("p/hb/3", 0), 1);  // the first beat happens at once
    int64_t first = store->add("p/hb/3", 0);
    for (int i = 0; i < 500 && store->add("p/hb/3", 0) == first; ++i) std::this_thread::sleep_for(10ms);
    EXPECT_GT(store->add("p/hb/3", 0), first);
  }
  int64_t stopped = store->add("p/hb/3", 0);
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(store->add("p/hb/3", 0), stopped) << "the thread stops with the Heartbeat";
}

TEST_F(ElasticRendezvousTest, ThreeNodesWithDifferentNprocInAnyOrder) {
  const int nprocs[3] = {2, 1, 3};
  std::vector<std::future<Round>> rounds;
  std::vector<std::unique_ptr<Launcher>> launchers;
  for (int i = 0; i < 3; ++i)
    launchers.push_back(std::make_unique<Launcher>(store, options(3, 3, nprocs[i], "h" + std::to_string(i)), signals));
  for (int i = 2; i >= 0; --i)
    rounds.push_back(std::async(std::launch::async, [&, i] { return launchers[i]->join(); }));
  std::set<int> node_ranks;
  std::string master;
  for (auto& f : rounds) {
    Round r = f.get();
    EXPECT_EQ(r.round, 0);
    ASSERT_EQ(r.nodes.size(), 3u);
    EXPECT_EQ(r.world_size, 6);
    node_ranks.insert(r.node_rank);
    int base = 0;
    for (const RoundNode& n : r.nodes) {
      EXPECT_EQ(n.rank_base, base);
      base += n.nproc;
    }
    std::string m = r.master_addr + ":" + std::to_string(r.master_port);
    if (master.empty()) master = m;
    EXPECT_EQ(m, master) << "every node sees node rank 0's MASTER_ADDR";
    EXPECT_EQ(r.master_addr, "10.0.0." + std::to_string(r.nodes[0].agent));
  }
  EXPECT_EQ(node_ranks, (std::set<int>{0, 1, 2}));
}

TEST_F(ElasticRendezvousTest, MinMaxClosesAfterTheLastCallWithMinNodes) {
  Launcher a(store, options(2, 3, 1, "a"), signals), b(store, options(2, 3, 1, "b"), signals);
  auto fa = std::async(std::launch::async, [&] { return a.join(); });
  Round rb = b.join();
  Round ra = fa.get();
  EXPECT_EQ(ra.nodes.size(), 2u);
  EXPECT_EQ(rb.nodes.size(), 2u);
  EXPECT_NE(ra.node_rank, rb.node_rank);
}

TEST_F(ElasticRendezvousTest, MaxNodesCloseAtOnceAndALateNodeJoinsTheNextRound) {
  auto o = options(1, 2, 1, "x");
  o.last_call = 60s;  // only reaching MAX can close round 0 in time
  Launcher a(store, o, signals), b(store, o, signals), late(store, o, signals);
  auto fa = std::async(std::launch::async, [&] { return a.join(); });
  Round rb = b.join();
  Round ra = fa.get();
  ASSERT_EQ(ra.nodes.size(), 2u);
  EXPECT_EQ(a.rdzv.waiting(0), 0);
  // A third launcher arrives while round 0 runs: it waits for round 1.
  auto flate = std::async(std::launch::async, [&] { return late.join(); });
  for (int i = 0; i < 1000 && a.rdzv.waiting(0) == 0; ++i) std::this_thread::sleep_for(5ms);
  EXPECT_EQ(a.rdzv.waiting(0), 1);
  EXPECT_EQ(flate.wait_for(100ms), std::future_status::timeout) << "round 1 must not start before the others restart";
  // Node a's workers fail; a and the late node meet in round 1 (MAX 2: b waits for round 2).
  a.rdzv.publish_failure(0, {"rank 0 exited with code 1", false});
  ASSERT_TRUE(b.rdzv.failure(0).has_value());
  EXPECT_FALSE(b.rdzv.failure(0)->final);
  Round r1 = a.join(1);
  Round rl = flate.get();
  EXPECT_EQ(r1.round, 1);
  EXPECT_EQ(rl.round, 1);
  EXPECT_EQ(r1.nodes.size(), 2u);
  EXPECT_NE(r1.node_rank, rl.node_rank);
}

TEST_F(ElasticRendezvousTest, TooFewNodesTimesOutSayingHowManyCame) {
  auto o = options(2, 3, 1, "lonely");
  o.join_timeout = 300ms;
  Launcher a(store, o, signals);
  try {
    a.join();
    FAIL() << "expected a TimeoutError";
  } catch (const TimeoutError& e) {
    EXPECT_TRUE(contains(e.what(), "only 1 node(s) joined round 0")) << e.what();
    EXPECT_TRUE(contains(e.what(), "--nnodes 2:3 needs at least 2")) << e.what();
  }
}

TEST_F(ElasticRendezvousTest, MismatchedMaxRestartsIsRefused) {
  auto o1 = options(2, 2, 1, "one"), o2 = options(2, 2, 1, "two");
  o2.max_restarts = 3;
  Launcher a(store, o1, signals), b(store, o2, signals);
  auto fa = std::async(std::launch::async, [&] {
    try {
      a.join();
      return std::string("no error");
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
  });
  try {
    b.join();
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(contains(e.what(), "--max-restarts")) << e.what();
  }
  EXPECT_TRUE(contains(fa.get(), "same value so they restart together"));
}

TEST_F(ElasticRendezvousTest, AWaitingNodeLearnsThatTheJobEnded) {
  auto o = options(1, 1, 1, "x");
  Launcher a(store, o, signals), late(store, o, signals);
  Round r = a.join();
  EXPECT_EQ(r.nodes.size(), 1u);
  auto flate = std::async(std::launch::async, [&] {
    try {
      late.join();
      return std::string("joined");
    } catch (const JobEnded& e) {
      return std::string(e.what());
    }
  });
  std::this_thread::sleep_for(50ms);
  a.rdzv.publish_end("ok");
  EXPECT_TRUE(contains(flate.get(), "the job finished before this launcher could join it"));
}

TEST_F(ElasticRendezvousTest, FinishWaitsForEveryNodeOrAFailure) {
  Launcher a(store, options(2, 2, 1, "a"), signals), b(store, options(2, 2, 1, "b"), signals);
  auto fa = std::async(std::launch::async, [&] { return a.join(); });
  Round rb = b.join();
  Round ra = fa.get();
  auto done_a = std::async(std::launch::async, [&] { return a.rdzv.finish(ra, nullptr); });
  EXPECT_EQ(done_a.wait_for(100ms), std::future_status::timeout);
  EXPECT_FALSE(b.rdzv.finish(rb, nullptr).has_value());
  EXPECT_FALSE(done_a.get().has_value());
}
