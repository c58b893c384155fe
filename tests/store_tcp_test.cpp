// TcpStore behaviour beyond the Store contract (store_test.cpp checks that):
// connect retry, a server that disappears, secrets, hostile input, knobs,
// and the wire format's pure encode/decode functions.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <optional>
#include <random>
#include <thread>

#include "cohort/error.hpp"
#include "cohort/store.hpp"
#include "store/tcp_protocol.hpp"
#include "scoped_env.hpp"

using namespace cohort;
using namespace std::chrono_literals;
namespace proto = cohort::store;

namespace {

Bytes B(const std::string& s) {
  return Bytes(s.begin(), s.end());
}

TcpStoreOptions at(uint16_t port, Millis connect_timeout = 10s) {
  return TcpStoreOptions{.host = "127.0.0.1", .port = port, .timeout = 20s, .connect_timeout = connect_timeout};
}

using cohort::testing::ScopedEnv;  // the stores read their knobs when constructed

// "127.0.0.1:PORT" (built with += : GCC 12 warns falsely on "literal" + std::string&&).
std::string local(uint16_t port) {
  std::string s = "127.0.0.1:";
  s += std::to_string(port);
  return s;
}

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

uint16_t free_port() {
  TcpStoreServer probe("127.0.0.1", 0);
  return probe.port();
}

// Connects and reads the server's Challenge (its nonce goes to *nonce).
int raw_connect(uint16_t port, proto::Nonce* nonce = nullptr) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  uint8_t challenge[proto::kChallengeBytes];
  size_t got = 0;
  while (got < sizeof(challenge)) {
    ssize_t r = ::recv(fd, challenge + got, sizeof(challenge) - got, 0);
    if (r <= 0) break;
    got += static_cast<size_t>(r);
  }
  proto::Nonce n{};
  uint16_t version = 0;
  EXPECT_TRUE(proto::decode_challenge(challenge, got, &n, &version));
  if (nonce != nullptr) *nonce = n;
  return fd;
}

// A correct Hello for the connection whose Challenge carried `nonce`.
Bytes good_hello(const proto::Nonce& nonce) {
  return proto::encode_hello(proto::configured_secret(), nonce);
}

void raw_send(int fd, const Bytes& b) {
  size_t off = 0;
  while (off < b.size()) {
    ssize_t w = ::send(fd, b.data() + off, b.size() - off, MSG_NOSIGNAL);
    if (w <= 0) return;  // the server may close before reading everything
    off += static_cast<size_t>(w);
  }
}

// True when the server closes fd (EOF or reset) within 10 s; whatever it
// sends first (a Welcome) is read and ignored.
bool closed_by_server(int fd) {
  auto t0 = std::chrono::steady_clock::now();
  uint8_t buf[4096];
  while (since(t0) < 10) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    ssize_t r = ::recv(fd, buf, sizeof(buf), 0);
    if (r <= 0) return true;
  }
  return false;
}

Bytes cat(Bytes a, const Bytes& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A frame whose body is given raw (length prefix computed).
Bytes frame(const Bytes& body) {
  Bytes out;
  proto::Writer w(out);
  w.u32(static_cast<uint32_t>(body.size()));
  return cat(out, body);
}

Bytes le32(uint32_t v) {
  return Bytes{uint8_t(v), uint8_t(v >> 8), uint8_t(v >> 16), uint8_t(v >> 24)};
}

TEST(TcpStore, ClientStartedBeforeServerConnectsWhenItAppears) {
  uint16_t port = free_port();
  std::unique_ptr<TcpStore> client;
  std::exception_ptr error;
  std::thread early([&] {
    try {
      client = std::make_unique<TcpStore>(at(port, 20s));
    } catch (...) {
      error = std::current_exception();
    }
  });
  std::this_thread::sleep_for(300ms);
  TcpStoreServer server("127.0.0.1", port);
  early.join();
  ASSERT_FALSE(error);
  client->set("k", B("v"));
  EXPECT_EQ(client->get_string("k"), "v");
}

TEST(TcpStore, ConnectGivesUpAtConnectTimeoutNamingTheAddress) {
  uint16_t port = free_port();
  auto t0 = std::chrono::steady_clock::now();
  try {
    TcpStore client(at(port, 300ms));
    FAIL() << "nothing listens there";
  } catch (const IoError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(local(port)), std::string::npos) << msg;
    EXPECT_NE(msg.find("MASTER_ADDR"), std::string::npos) << msg;
  }
  EXPECT_LT(since(t0), 10);
}

TEST(TcpStore, ServerDestroyedWhileClientsWaitGivesIoErrorPromptly) {
  auto server = std::make_unique<TcpStoreServer>("127.0.0.1", 0);
  uint16_t port = server->port();
  constexpr int kWaiters = 8;
  std::vector<std::unique_ptr<TcpStore>> clients;
  for (int i = 0; i < kWaiters; ++i) clients.push_back(std::make_unique<TcpStore>(at(port, 300ms)));
  std::vector<std::string> errors(kWaiters);
  std::vector<std::thread> threads;
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kWaiters; ++i)
    threads.emplace_back([&, i] {
      try {
        if (i % 2)
          clients[i]->get("never", 60s);
        else
          clients[i]->wait({"never", "nor_this"}, 60s);
      } catch (const IoError& e) {
        errors[i] = e.what();
      }
    });
  std::this_thread::sleep_for(100ms);
  server.reset();
  for (auto& t : threads) t.join();
  EXPECT_LT(since(t0), 20);
  for (const auto& msg : errors) {
    EXPECT_NE(msg.find(local(port)), std::string::npos) << msg;
    EXPECT_NE(msg.find("closed the connection"), std::string::npos) << msg;
  }
  // The next call tries to reconnect, bounded by connect_timeout.
  EXPECT_THROW(clients[0]->set("x", B("1")), IoError);
}

TEST(TcpStore, WrongSecretIsRefusedWithAHint) {
  ScopedEnv right("COHORT_STORE_SECRET", "right");
  TcpStoreServer server("127.0.0.1", 0);
  TcpStore(at(server.port())).set("k", B("v"));  // the same secret gets in
  for (const char* secret : {"wrong", ""}) {
    ScopedEnv wrong("COHORT_STORE_SECRET", secret);
    auto t0 = std::chrono::steady_clock::now();
    try {
      TcpStore client(at(server.port(), 20s));
      FAIL() << "a client with secret '" << secret << "' got in";
    } catch (const IoError& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find("secret did not match"), std::string::npos) << msg;
      EXPECT_NE(msg.find("COHORT_STORE_SECRET"), std::string::npos) << msg;
    }
    EXPECT_LT(since(t0), 10);  // a refusal is final: no retrying until connect_timeout
  }
}

TEST(TcpStore, MalformedInputClosesOnlyThatConnection) {
  TcpStoreServer server("127.0.0.1", 0);
  TcpStore good(at(server.port()));
  good.set("k", B("v"));
  Bytes get_never = proto::encode_request({.op = proto::Op::Get, .keys = {"never"}});
  Bytes set_k = proto::encode_request({.op = proto::Op::Set, .keys = {"k"}, .value = B("evil")});
  // Each case gets this connection's good Hello and returns the bytes to send.
  using Make = std::function<Bytes(const Bytes& hello)>;
  std::vector<std::pair<const char*, Make>> cases = {
      {"http request", [](const Bytes&) { return B("GET / HTTP/1.1\r\nHost: x\r\n\r\n"); }},
      {"other version",
       [](Bytes h) {
         h[4] = 99;
         return h;
       }},
      {"wrong proof",
       [](Bytes h) {
         h[20] ^= 1;
         return h;
       }},
      {"proof for another connection", [](const Bytes&) { return good_hello(proto::Nonce{}); }},
      {"huge frame", [](const Bytes& h) { return cat(h, cat(le32(0xfffffff0u), B("abcd"))); }},
      {"empty frame", [](const Bytes& h) { return cat(h, le32(0)); }},
      {"unknown op", [](const Bytes& h) { return cat(h, frame({200})); }},
      {"key past the frame", [](const Bytes& h) { return cat(h, frame(cat({1}, cat(le32(1000), B("ab"))))); }},
      {"trailing bytes",
       [](const Bytes& h) {
         return cat(h, frame({8, 0}));
       }},
      {"wait count too big", [](const Bytes& h) { return cat(h, frame(cat({5}, le32(0xffffffffu)))); }},
      {"request while waiting", [&](const Bytes& h) { return cat(h, cat(get_never, set_k)); }},
  };
  for (const auto& [name, make] : cases) {
    proto::Nonce nonce{};
    int fd = raw_connect(server.port(), &nonce);
    raw_send(fd, make(good_hello(nonce)));
    EXPECT_TRUE(closed_by_server(fd)) << name;
    ::close(fd);
  }
  // Random bytes after a good handshake, and connections cut mid-frame.
  std::mt19937 rng(1);
  for (int i = 0; i < 50; ++i) {
    Bytes junk(rng() % 300);
    for (auto& b : junk) b = static_cast<uint8_t>(rng());
    proto::Nonce nonce{};
    int fd = raw_connect(server.port(), &nonce);
    raw_send(fd, cat(good_hello(nonce), junk));
    ::close(fd);
  }
  EXPECT_EQ(good.get_string("k"), "v");
  TcpStore fresh(at(server.port()));
  EXPECT_EQ(fresh.get_string("k"), "v");
  EXPECT_EQ(fresh.num_keys(), 1);
}

TEST(TcpStore, MaxFrameKnobBoundsRequests) {
  ScopedEnv small("COHORT_STORE_MAX_FRAME", "64K");
  TcpStoreServer server("127.0.0.1", 0);
  TcpStore client(at(server.port()));
  EXPECT_THROW(client.set("big", Bytes(100000)), InvalidArgument);  // refused before sending
  client.set("fits", Bytes(60000));
  EXPECT_EQ(client.get("fits").size(), 60000u);
  proto::Nonce nonce{};
  int fd = raw_connect(server.port(), &nonce);
  raw_send(fd, cat(good_hello(nonce), le32(100000)));
  EXPECT_TRUE(closed_by_server(fd));
  ::close(fd);
}

TEST(TcpStore, PortInUseIsIoErrorNamingTheAddress) {
  TcpStoreServer first("127.0.0.1", 0);
  try {
    TcpStoreServer second("127.0.0.1", first.port());
    FAIL() << "two servers on one port";
  } catch (const IoError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(local(first.port())), std::string::npos) << msg;
    EXPECT_NE(msg.find("HINT"), std::string::npos) << msg;
  }
}

TEST(TcpStore, IsServerRunsTheServerInProcess) {
  TcpStore owner({.host = "127.0.0.1", .port = 0, .is_server = true, .server_host = "127.0.0.1"});
  ASSERT_NE(owner.port(), 0);
  TcpStore other(at(owner.port()));
  other.set("x", B("1"));
  EXPECT_EQ(owner.get_string("x"), "1");
}

TEST(TcpStore, RepeatedTimeoutsKeepTheStreamInStep) {
  TcpStoreServer server("127.0.0.1", 0);
  TcpStore client(at(server.port()));
  TcpStore setter(at(server.port()));
  for (int i = 0; i < 30; ++i) {
    std::string k = fmt::format("k{}", i);
    // Races the set against the deadline: the reply may cross the CANCEL.
    std::thread t([&] { setter.set(k, B(k)); });
    try {
      EXPECT_EQ(client.get_string(k, Millis(i % 3)), k);
    } catch (const TimeoutError&) {
    }
    t.join();
    EXPECT_EQ(client.get_string(k), k);
    EXPECT_EQ(client.add("n", 1), i + 1);
  }
}

TEST(TcpProtocol, RequestsRoundTrip) {
  std::vector<proto::Request> reqs = {
      {.op = proto::Op::Set, .keys = {"k"}, .value = B("v")},
      {.op = proto::Op::Get, .keys = {""}},
      {.op = proto::Op::Add, .keys = {"n"}, .delta = -7},
      {.op = proto::Op::CompareSet, .keys = {"k"}, .value = B("new"), .expected = B("old")},
      {.op = proto::Op::Wait, .keys = {"a", "b", "c"}},
      {.op = proto::Op::Check, .keys = {}},
      {.op = proto::Op::Delete, .keys = {"k"}},
      {.op = proto::Op::NumKeys},
      {.op = proto::Op::Cancel},
  };
  for (const auto& req : reqs) {
    Bytes f = proto::encode_request(req);
    proto::Request got;
    std::string why;
    ASSERT_TRUE(proto::decode_request(f.data() + 4, f.size() - 4, &got, &why)) << why;
    EXPECT_EQ(got.op, req.op);
    EXPECT_EQ(got.keys, req.keys);
    EXPECT_EQ(got.value, req.value);
    EXPECT_EQ(got.expected, req.expected);
    EXPECT_EQ(got.delta, req.delta);
    for (size_t cut = 0; cut + 4 < f.size(); ++cut)  // every truncation is refused
      EXPECT_FALSE(proto::decode_request(f.data() + 4, cut, &got, &why)) << proto::op_name(req.op) << " cut " << cut;
  }
}

TEST(TcpProtocol, ResponsesRoundTrip) {
  proto::Response value{.value = B("v")}, number{.number = 42}, flag{.flag = true};
  proto::Response error{.status = proto::Status::Error, .message = "no"};
  proto::Response cancelled{.status = proto::Status::Cancelled, .missing = {"a", "b"}};
  proto::Response got;
  std::string why;
  auto rt = [&](proto::Op op, const proto::Response& r) {
    Bytes f = proto::encode_response(op, r);
    return proto::decode_response(op, f.data() + 4, f.size() - 4, &got, &why);
  };
  ASSERT_TRUE(rt(proto::Op::Get, value));
  EXPECT_EQ(got.value, B("v"));
  ASSERT_TRUE(rt(proto::Op::NumKeys, number));
  EXPECT_EQ(got.number, 42);
  ASSERT_TRUE(rt(proto::Op::Delete, flag));
  EXPECT_TRUE(got.flag);
  ASSERT_TRUE(rt(proto::Op::Add, error));
  EXPECT_EQ(got.message, "no");
  ASSERT_TRUE(rt(proto::Op::Wait, cancelled));
  EXPECT_EQ(got.missing, (std::vector<std::string>{"a", "b"}));
}

TEST(TcpProtocol, RandomBytesNeverCrashTheDecoders) {
  std::mt19937 rng(3);
  proto::Request req;
  proto::Response resp;
  std::string why;
  for (int i = 0; i < 20000; ++i) {
    Bytes body(rng() % 40);
    for (auto& b : body) b = static_cast<uint8_t>(rng() % 12);  // small values: plausible ops and lengths
    proto::decode_request(body.data(), body.size(), &req, &why);
    proto::decode_response(static_cast<proto::Op>(1 + i % 9), body.data(), body.size(), &resp, &why);
    proto::check_hello(body.data(), body.size(), "s", proto::Nonce{});
    proto::Nonce n;
    uint16_t v = 0;
    proto::decode_challenge(body.data(), body.size(), &n, &v);
  }
}

TEST(TcpProtocol, HelloVerdicts) {
  using V = proto::HelloVerdict;
  proto::Nonce nonce = proto::make_nonce(), other_nonce = proto::make_nonce();
  Bytes good = proto::encode_hello("secret", nonce);
  ASSERT_EQ(good.size(), proto::kHelloBytes);
  EXPECT_EQ(proto::check_hello(good.data(), good.size(), "secret", nonce).verdict, V::Ok);
  EXPECT_EQ(proto::check_hello(good.data(), good.size(), "secret", nonce).used, good.size());
  EXPECT_EQ(proto::check_hello(good.data(), good.size() - 1, "secret", nonce).verdict, V::NeedMore);
  EXPECT_EQ(proto::check_hello(good.data(), good.size(), "secreT", nonce).verdict, V::BadSecret);
  EXPECT_EQ(proto::check_hello(good.data(), good.size(), "", nonce).verdict, V::BadSecret);
  EXPECT_EQ(proto::check_hello(good.data(), good.size(), "secret", other_nonce).verdict, V::BadSecret) << "a replay";
  Bytes other = good;
  other[4] = 1;
  EXPECT_EQ(proto::check_hello(other.data(), other.size(), "secret", nonce).verdict, V::BadVersion);
  other = good;
  other[0] ^= 1;
  EXPECT_EQ(proto::check_hello(other.data(), 4, "secret", nonce).verdict, V::BadMagic);
  // The secret itself never crosses the wire.
  const std::string secret = "a-long-recognisable-secret";
  Bytes h = proto::encode_hello(secret, nonce);
  EXPECT_EQ(std::search(h.begin(), h.end(), secret.begin(), secret.end()), h.end());
}

}  // namespace
