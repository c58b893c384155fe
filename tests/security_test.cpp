// The job secret and the handshakes built on it: SHA-256 / HMAC-SHA256
// against the FIPS 180-4 and RFC 4231 vectors, the TCP transport's
// challenge-response, and connections without the secret (or with malformed
// handshakes) refused by the store and by a rank's TCP listener.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <thread>

#include "cohort/cohort.hpp"
#include "core/job_secret.hpp"
#include "core/sha256.hpp"
#include "group/job_settings.hpp"
#include "store/tcp_protocol.hpp"
#include "transport/tcp/tcp_hello.hpp"
#include "scoped_env.hpp"

namespace cohort {
namespace {

namespace th = transport::tcp_hello;

using cohort::testing::ScopedEnv;

std::string hex(const core::Digest& d) {
  return core::to_hex(d.data(), d.size());
}
std::string sha(const std::string& s) {
  return hex(core::sha256(s.data(), s.size()));
}

TEST(Sha256, Fips180Vectors) {
  EXPECT_EQ(sha(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  // One million 'a', fed in uneven pieces (exercises the buffering).
  core::Sha256 s;
  std::string chunk(997, 'a');
  size_t left = 1000000;
  while (left > 0) {
    size_t n = std::min(left, chunk.size());
    s.update(chunk.data(), n);
    left -= n;
  }
  EXPECT_EQ(hex(s.finish()), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, HmacRfc4231Vectors) {
  const std::string key1(20, '\x0b'), msg1 = "Hi There";
  EXPECT_EQ(hex(core::hmac_sha256(key1, msg1.data(), msg1.size())),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  const std::string msg2 = "what do ya want for nothing?";
  EXPECT_EQ(hex(core::hmac_sha256("Jefe", msg2.data(), msg2.size())),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  const std::string key6(131, '\xaa'), msg6 = "Test Using Larger Than Block-Size Key - Hash Key First";
  EXPECT_EQ(hex(core::hmac_sha256(key6, msg6.data(), msg6.size())),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

TEST(JobSecret, SourcesInOrderAndABadFileIsAClearError) {
  ScopedEnv a("COHORT_SECRET", nullptr), b("COHORT_SECRET_FILE", nullptr), c("COHORT_STORE_SECRET", nullptr);
  EXPECT_EQ(core::job_secret(), "");
  {
    ScopedEnv old("COHORT_STORE_SECRET", "old");
    EXPECT_EQ(core::job_secret(), "old");
    const std::string path = ::testing::TempDir() + "/cohort_secret_file";
    FILE* f = std::fopen(path.c_str(), "w");
    std::fputs("from-file\n", f);
    std::fclose(f);
    ScopedEnv file("COHORT_SECRET_FILE", path.c_str());
    EXPECT_EQ(core::job_secret(), "from-file");
    ScopedEnv direct("COHORT_SECRET", "direct");
    EXPECT_EQ(core::job_secret(), "direct");
  }
  ScopedEnv missing("COHORT_SECRET_FILE", "/nonexistent/cohort/secret");
  try {
    core::job_secret();
    FAIL() << "an unreadable secret file was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("COHORT_SECRET_FILE=/nonexistent/cohort/secret cannot be read"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(core::random_secret().size(), 64u);
  EXPECT_NE(core::random_secret(), core::random_secret());
}

TEST(TcpHello, ProofBindsSecretNonceAndFields) {
  th::Nonce n = th::make_nonce();
  th::HelloFields f{0x1234567890abcdefull, 3, 1};
  auto hello = th::encode_hello("s3cret", n, f);
  th::HelloFields got;
  EXPECT_EQ(th::check_hello(hello.data(), hello.size(), "s3cret", n, &got), th::Verdict::Ok);
  EXPECT_EQ(got.group_hash, f.group_hash);
  EXPECT_EQ(got.rank, 3);
  EXPECT_EQ(got.socket, 1u);
  EXPECT_EQ(th::check_hello(hello.data(), hello.size(), "other", n, &got), th::Verdict::BadProof);
  EXPECT_EQ(th::check_hello(hello.data(), hello.size(), "s3cret", th::make_nonce(), &got), th::Verdict::BadProof);
  auto forged = hello;
  forged[16] = 2;  // claim another rank with the same proof
  EXPECT_EQ(th::check_hello(forged.data(), forged.size(), "s3cret", n, &got), th::Verdict::BadProof);
  EXPECT_EQ(th::check_hello(hello.data(), 7, "s3cret", n, &got), th::Verdict::Short);
  EXPECT_EQ(th::check_hello(hello.data(), hello.size() - 1, "s3cret", n, &got), th::Verdict::Short);
  forged = hello;
  forged[0] ^= 1;
  EXPECT_EQ(th::check_hello(forged.data(), forged.size(), "s3cret", n, &got), th::Verdict::BadMagic);
  forged = hello;
  forged[4] = 1;
  EXPECT_EQ(th::check_hello(forged.data(), forged.size(), "s3cret", n, &got), th::Verdict::BadVersion);
  auto ch = th::encode_challenge(n);
  th::Nonce back{};
  EXPECT_EQ(th::check_challenge(ch.data(), ch.size(), &back), th::Verdict::Ok);
  EXPECT_EQ(back, n);
  EXPECT_EQ(th::check_challenge(ch.data(), ch.size() - 1, &back), th::Verdict::Short);
}

// Connects to 127.0.0.1:port (or "host:port").
int raw_connect(const std::string& hostport) {
  auto c = hostport.rfind(':');
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(std::stoi(hostport.substr(c + 1))));
  ::inet_pton(AF_INET, hostport.substr(0, c).c_str(), &a.sin_addr);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0) << hostport;
  return fd;
}

// Reads until the peer closes (true) or 10 s pass (false); returns what came before in *got.
bool read_until_closed(int fd, Bytes* got) {
  auto t0 = std::chrono::steady_clock::now();
  uint8_t buf[4096];
  while (std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10)) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    ssize_t r = ::recv(fd, buf, sizeof(buf), 0);
    if (r <= 0) return true;
    got->insert(got->end(), buf, buf + r);
  }
  return false;
}

void send_bytes(int fd, const Bytes& b) {
  (void)::send(fd, b.data(), b.size(), MSG_NOSIGNAL);
}

TEST(StoreSecurity, ClientsWithoutTheSecretCannotReadOrWrite) {
  ScopedEnv secret("COHORT_SECRET", "job-secret-1");
  TcpStoreServer server("127.0.0.1", 0);
  TcpStoreOptions o;
  o.port = server.port();
  o.connect_timeout = std::chrono::seconds(5);
  TcpStore good(o);
  good.set_string("k", "v");
  {
    ScopedEnv wrong("COHORT_SECRET", "not-the-secret");
    EXPECT_THROW(TcpStore bad(o), IoError);
  }
  {
    ScopedEnv none("COHORT_SECRET", nullptr);
    EXPECT_THROW(TcpStore bad(o), IoError);
  }
  const std::string where = "127.0.0.1:" + std::to_string(server.port());
  // A request without any handshake: closed, and no value comes back.
  {
    int fd = raw_connect(where);
    send_bytes(fd, store::encode_request({.op = store::Op::Get, .keys = {"k"}}));
    Bytes got;
    EXPECT_TRUE(read_until_closed(fd, &got));
    EXPECT_EQ(got.size(), store::kChallengeBytes) << "only the challenge may come back";
    ::close(fd);
  }
  // The v1 handshake (the secret in clear) and a replayed v2 Hello: refused, then a SET is not applied.
  for (int replay = 0; replay < 2; ++replay) {
    int fd = raw_connect(where);
    Bytes hello;
    if (replay) {
      hello = store::encode_hello("job-secret-1", store::make_nonce());  // a proof for another nonce
    } else {
      hello = {0x43, 0x48, 0x53, 0x54, 1, 0, 0, 0, 12, 0, 0, 0};
      const std::string s = "job-secret-1";
      hello.insert(hello.end(), s.begin(), s.end());
    }
    Bytes set = store::encode_request({.op = store::Op::Set, .keys = {"k"}, .value = {'x'}});
    hello.insert(hello.end(), set.begin(), set.end());
    send_bytes(fd, hello);
    Bytes got;
    EXPECT_TRUE(read_until_closed(fd, &got));
    ::close(fd);
  }
  EXPECT_EQ(good.get_string("k"), "v");
}

// Rank 0 of a 2-rank TCP group listens; before rank 1 arrives, intruders try
// its port: garbage, a Hello with the wrong secret, nothing at all. Each is
// closed; then the real rank 1 connects and the allreduce is right.
TEST(TransportSecurity, RankListenerRefusesIntruders) {
  ScopedEnv secret("COHORT_SECRET", "job-secret-2");
  ScopedEnv restart("TORCHELASTIC_RESTART_COUNT", nullptr);
  auto store = std::make_shared<MemoryStore>();
  // Stand in for rank 1's host record so that rank 0 starts listening before rank 1 exists.
  // (Its host identity, machine and settings, as NativeGroup::connect writes them.)
  store->set_string("cohort/0/g0/host/1", "elsewhere\n\n" + group::job_wide_settings("tcp"));
  auto init = [&](int rank) {
    InitOptions o;
    o.rank = rank;
    o.world_size = 2;
    o.store = store;
    o.transport = "tcp";
    o.timeout = Millis(60000);
    return init_process_group(o);
  };
  std::exception_ptr err0;
  std::vector<float> v0(1000, 1.0f);
  std::thread rank0([&] {
    try {
      auto pg = init(0);
      pg->allreduce(buffer(v0))->wait();
      pg->shutdown();
    } catch (...) {
      err0 = std::current_exception();
    }
  });
  const std::string addr = store->get_string("cohort/0/g0/tcp/0", Millis(30000));
  {
    int fd = raw_connect(addr);
    send_bytes(fd, Bytes{'G', 'E', 'T', ' ', '/', ' ', 'H', 'T', 'T', 'P', '/', '1', '.', '0', '\r', '\n', '\r', '\n'});
    Bytes got;
    EXPECT_TRUE(read_until_closed(fd, &got)) << "garbage";
    ::close(fd);
  }
  {
    int fd = raw_connect(addr);
    uint8_t ch[th::kChallengeBytes];
    ASSERT_EQ(::recv(fd, ch, sizeof(ch), MSG_WAITALL), static_cast<ssize_t>(sizeof(ch)));
    th::Nonce n{};
    ASSERT_EQ(th::check_challenge(ch, sizeof(ch), &n), th::Verdict::Ok);
    auto hello = th::encode_hello("wrong-secret", n, {0, 1, 0});
    send_bytes(fd, Bytes(hello.begin(), hello.end()));
    Bytes got;
    EXPECT_TRUE(read_until_closed(fd, &got)) << "wrong secret";
    ::close(fd);
  }
  {
    int fd = raw_connect(addr);
    ::shutdown(fd, SHUT_WR);  // says nothing
    Bytes got;
    EXPECT_TRUE(read_until_closed(fd, &got)) << "silent";
    ::close(fd);
  }
  std::vector<float> v1(1000, 2.0f);
  auto pg1 = init(1);
  pg1->allreduce(buffer(v1))->wait();
  pg1->shutdown();
  rank0.join();
  if (err0) std::rethrow_exception(err0);
  EXPECT_EQ(v0[999], 3.0f);
  EXPECT_EQ(v1[0], 3.0f);
}

}  // namespace
}  // namespace cohort
