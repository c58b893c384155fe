// The Store contract, checked on every implementation through one
// parameterised suite: MemoryStore, PrefixStore (over a MemoryStore) and
// TcpStore (clients of a TcpStoreServer on a free port). TCP-only behaviour
// (connect retry, server death, secrets, malformed frames) is in store_tcp_test.cpp.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <random>
#include <thread>

#include "cohort/error.hpp"
#include "cohort/store.hpp"

using namespace cohort;
using namespace std::chrono_literals;

namespace {

enum class Kind { Memory, Prefix, Tcp };
void PrintTo(Kind k, std::ostream* os) { *os << (k == Kind::Memory ? "memory" : k == Kind::Prefix ? "prefix" : "tcp"); }

Bytes B(const std::string& s) { return Bytes(s.begin(), s.end()); }

class StoreTest : public ::testing::TestWithParam<Kind> {
 protected:
  void SetUp() override {
    mem_ = std::make_shared<MemoryStore>();
    mem_->set_timeout(20s);  // before any thread shares it; PrefixStores copy it
    if (GetParam() == Kind::Tcp) server_ = std::make_unique<TcpStoreServer>("127.0.0.1", 0);
    store_ = client();
  }

  // Another handle onto the same store: for TCP a new connection, so that a
  // thread blocked in get() does not hold up the thread that sets the key.
  std::shared_ptr<Store> client() {
    std::shared_ptr<Store> s;
    switch (GetParam()) {
      case Kind::Memory: s = mem_; break;
      case Kind::Prefix: s = std::make_shared<PrefixStore>("job", mem_); break;
      case Kind::Tcp:
        s = std::make_shared<TcpStore>(TcpStoreOptions{.host = "127.0.0.1", .port = server_->port(),
                                                       .timeout = 20s, .connect_timeout = 10s});
        break;
    }
    return s;
  }

  std::shared_ptr<MemoryStore> mem_;
  std::unique_ptr<TcpStoreServer> server_;
  std::shared_ptr<Store> store_;
};

template <class F>
double seconds_to_run(F&& f) {
  auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

TEST_P(StoreTest, SetThenGetReturnsLatestValue) {
  store_->set("a", B("1"));
  EXPECT_EQ(store_->get("a"), B("1"));
  store_->set("a", B("two"));
  EXPECT_EQ(store_->get_string("a"), "two");
  store_->set("empty", {});
  EXPECT_EQ(store_->get("empty"), Bytes{});
}

TEST_P(StoreTest, GetBlocksUntilAnotherThreadSets) {
  auto other = client();
  std::thread setter([&] {
    std::this_thread::sleep_for(50ms);
    other->set("late", B("here"));
  });
  EXPECT_EQ(store_->get_string("late", 10s), "here");
  setter.join();
}

TEST_P(StoreTest, AddIsAtomicAcrossThreads) {
  constexpr int kThreads = 8, kAdds = 200;
  std::vector<std::vector<int64_t>> seen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t, s = client()] {
      for (int i = 0; i < kAdds; ++i) seen[t].push_back(s->add("counter", 1));
    });
  for (auto& th : threads) th.join();
  // Every add returned a distinct value and together they are exactly 1..N.
  std::vector<int64_t> all;
  for (auto& v : seen) all.insert(all.end(), v.begin(), v.end());
  std::sort(all.begin(), all.end());
  ASSERT_EQ(all.size(), size_t{kThreads * kAdds});
  for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], static_cast<int64_t>(i + 1));
  EXPECT_EQ(store_->get_string("counter"), std::to_string(kThreads * kAdds));
  EXPECT_EQ(store_->add("counter", -kThreads * kAdds), 0);
  EXPECT_EQ(store_->add("fresh", -5), -5);
}

TEST_P(StoreTest, AddOnTextIsInvalidArgumentNamingTheKey) {
  store_->set("text", B("hello"));
  try {
    store_->add("text", 1);
    FAIL() << "add on text should throw";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("text"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("HINT"), std::string::npos) << e.what();
  }
  EXPECT_EQ(store_->add("other", 2), 2);  // the store (and a TCP connection) still works
}

TEST_P(StoreTest, CompareSetFollowsC10dSemantics) {
  // Missing key, empty expected: stores desired.
  EXPECT_EQ(store_->compare_set("k", {}, B("v1")), B("v1"));
  EXPECT_EQ(store_->get("k"), B("v1"));
  // Missing key, non-empty expected: stores nothing, returns expected.
  EXPECT_EQ(store_->compare_set("missing", B("x"), B("y")), B("x"));
  EXPECT_FALSE(store_->check({"missing"}));
  // Match: stores desired.
  EXPECT_EQ(store_->compare_set("k", B("v1"), B("v2")), B("v2"));
  EXPECT_EQ(store_->get("k"), B("v2"));
  // Mismatch: returns the current value, changes nothing.
  EXPECT_EQ(store_->compare_set("k", B("nope"), B("v3")), B("v2"));
  EXPECT_EQ(store_->get("k"), B("v2"));
}

TEST_P(StoreTest, CompareSetWakesWaiters) {
  auto other = client();
  std::thread setter([&] {
    std::this_thread::sleep_for(30ms);
    other->compare_set("cas", {}, B("won"));
  });
  EXPECT_EQ(store_->get_string("cas", 10s), "won");
  setter.join();
}

TEST_P(StoreTest, WaitReturnsOnceEveryKeyExists) {
  store_->wait({});  // nothing to wait for
  auto other = client();
  std::thread setter([&] {
    other->set("w1", B("1"));
    std::this_thread::sleep_for(30ms);
    other->add("w2", 1);
    std::this_thread::sleep_for(30ms);
    other->set("w3", B("3"));
  });
  store_->wait({"w1", "w2", "w3"}, 10s);
  EXPECT_TRUE(store_->check({"w1", "w2", "w3"}));
  setter.join();
}

TEST_P(StoreTest, WaitTimeoutNamesTheMissingKeys) {
  store_->set("present", B("1"));
  std::string msg;
  double took = seconds_to_run([&] {
    try {
      store_->wait({"present", "absent"}, 200ms);
    } catch (const TimeoutError& e) {
      msg = e.what();
    }
  });
  ASSERT_FALSE(msg.empty()) << "wait should time out";
  EXPECT_LT(took, 10.0);
  EXPECT_NE(msg.find("timed out after 200 ms"), std::string::npos) << msg;
  std::string missing = "(missing: ";
  missing += GetParam() == Kind::Prefix ? "job/absent)" : "absent)";
  EXPECT_NE(msg.find(missing), std::string::npos) << msg;
  EXPECT_NE(msg.find("HINT"), std::string::npos) << msg;
  // After a timeout the store (for TCP: the same connection) keeps working.
  store_->set("absent", B("now"));
  store_->wait({"present", "absent"}, 1s);
  EXPECT_EQ(store_->get_string("absent"), "now");
}

TEST_P(StoreTest, GetTimeoutNamesTheKey) {
  try {
    store_->get("never", 150ms);
    FAIL() << "get should time out";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("never"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("store get timed out after 150 ms waiting for key "), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(store_->add("after", 1), 1);
  // Zero and negative timeouts look once and do not wait.
  EXPECT_THROW(store_->get("never", 0ms), TimeoutError);
  EXPECT_THROW(store_->wait({"never"}, -5ms), TimeoutError);
  store_->wait({"after"}, 0ms);
}

TEST_P(StoreTest, CheckDeleteAndNumKeys) {
  EXPECT_EQ(store_->num_keys(), 0);
  EXPECT_TRUE(store_->check({}));
  EXPECT_FALSE(store_->check({"x"}));
  store_->set("x", B("1"));
  store_->set("y", B("2"));
  EXPECT_TRUE(store_->check({"x", "y"}));
  EXPECT_FALSE(store_->check({"x", "z"}));
  EXPECT_EQ(store_->num_keys(), 2);
  EXPECT_TRUE(store_->delete_key("x"));
  EXPECT_FALSE(store_->delete_key("x"));
  EXPECT_FALSE(store_->check({"x"}));
  EXPECT_EQ(store_->num_keys(), 1);
}

TEST_P(StoreTest, LargeValuesRoundTrip) {
  Bytes big(8 << 20);
  std::mt19937 rng(7);
  for (auto& b : big) b = static_cast<uint8_t>(rng());
  store_->set("big", big);
  EXPECT_EQ(store_->get("big"), big);
  auto other = client();
  EXPECT_EQ(other->get("big"), big);
  EXPECT_EQ(store_->compare_set("big", big, B("small")), B("small"));
}

TEST_P(StoreTest, ManyConcurrentClientsRendezvous) {
  constexpr int kClients = 64;
  std::vector<std::string> keys;
  for (int i = 0; i < kClients; ++i) keys.push_back(fmt::format("rank{}", i));
  std::atomic<int> done{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i)
    threads.emplace_back([&, i] {
      auto s = client();
      s->set(keys[i], B(std::to_string(i)));
      s->add("arrived", 1);
      s->wait(keys, 30s);
      EXPECT_EQ(s->get_string(keys[(i + 1) % kClients]), std::to_string((i + 1) % kClients));
      done++;
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(done.load(), kClients);
  EXPECT_EQ(store_->get_string("arrived"), std::to_string(kClients));
}

TEST_P(StoreTest, ThreadsMayShareOneHandle) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) {
        std::string k = fmt::format("t{}_{}", t, i);
        store_->set(k, B(k));
        EXPECT_EQ(store_->get_string(k), k);
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(store_->num_keys(), 200);
}

INSTANTIATE_TEST_SUITE_P(AllStores, StoreTest, ::testing::Values(Kind::Memory, Kind::Prefix, Kind::Tcp),
                         [](const auto& info) {
                           switch (info.param) {
                             case Kind::Memory: return std::string("Memory");
                             case Kind::Prefix: return std::string("Prefix");
                             case Kind::Tcp: return std::string("Tcp");
                           }
                           return std::string("Unknown");
                         });

TEST(PrefixStore, NamespacesKeysOnTheBaseStore) {
  auto base = std::make_shared<MemoryStore>();
  PrefixStore a("a", base), b("b", base);
  a.set("k", B("from a"));
  b.set("k", B("from b"));
  EXPECT_EQ(base->get_string("a/k"), "from a");
  EXPECT_EQ(b.get_string("k"), "from b");
  EXPECT_EQ(a.num_keys(), 2);  // the base store's count, as c10d does
  PrefixStore nested("inner", std::make_shared<PrefixStore>("outer", base));
  nested.set("k", B("deep"));
  EXPECT_TRUE(base->check({"outer/inner/k"}));
  EXPECT_THROW(PrefixStore("x", nullptr), InvalidArgument);
}

}  // namespace
