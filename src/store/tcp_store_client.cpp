// TcpStore: the client half. One TCP connection to a TcpStoreServer; a mutex
// serialises calls, so a thread blocked in get() or wait() holds the
// connection and other threads' calls on the same TcpStore queue behind it.
// (A thread that must set the key another thread waits for needs its own TcpStore.)
//
// Every call is bounded: sends and receives poll against a deadline, the
// call's timeout for get/wait and the store's timeout() for the rest.
//
// Timeouts of get/wait. The server answers GET/WAIT only once the keys exist.
// When the client's deadline passes it sends CANCEL and reads the one response
// its request will ever get: "cancelled" with the keys still missing (which
// the TimeoutError names), or the real answer if that crossed the CANCEL on
// the wire. We chose CANCEL over closing and reconnecting because the server
// knows which keys are missing at that instant (a reconnect would cost a
// second connection and round trip to learn it), and the connection survives,
// which matters when hundreds of ranks poll with short timeouts. The CANCEL's
// answer gets its own deadline (kCancelGrace).
//
// Any other failure midway (server gone, deadline inside a frame, garbage)
// leaves the stream at an unknown place: the connection is closed, the call
// throws, and the next call reconnects (retrying until connect_timeout).
#include <mutex>
#include <random>
#include <thread>

#include <fmt/format.h>

#include "cohort/error.hpp"
#include "cohort/store.hpp"
#include "core/log.hpp"
#include "store/kv_table.hpp"
#include "store/net.hpp"
#include "store/tcp_protocol.hpp"

namespace cohort {
namespace {

namespace net = store::net;
using store::Op;
using store::Request;
using store::Response;
using net::IoStatus;

constexpr Millis kCancelGrace{5000};  // how long a cancelled GET/WAIT may take to answer the CANCEL
constexpr Millis kFirstBackoff{10};
constexpr Millis kMaxBackoff{1000};

std::string describe(const Request& req) {
  if (req.op == Op::Wait || req.op == Op::Check) return fmt::format("{}({})", store::op_name(req.op), store::format_keys(req.keys));
  if (req.keys.empty()) return fmt::format("{}()", store::op_name(req.op));
  return fmt::format("{}({})", store::op_name(req.op), req.keys[0]);
}

}  // namespace

struct COHORT_HIDDEN TcpStore::Impl {
  TcpStoreOptions opts;
  std::unique_ptr<TcpStoreServer> server;  // only when opts.is_server
  uint16_t port = 0;
  std::string where;  // "host:port" of the server, for every message
  std::string secret = store::configured_secret();
  uint64_t max_frame = store::configured_max_frame();
  std::mutex mu;  // serialises calls; guards fd
  net::Fd fd;     // invalid: the next call connects first

  ~Impl() {
    fd.reset();      // leave before the in-process server stops, so it sees a clean close
    server.reset();
  }
  void connect();
  bool handshake(net::Fd& s, core::Deadline deadline, std::string* why);
  Response call(const Request& req, Millis timeout);
  void receive(uint8_t* p, size_t n, const Request& req, Millis timeout, core::Deadline* deadline, bool* cancelled);
  [[noreturn]] void fail(IoStatus st, int err, const Request& req, const char* phase, Millis timeout);
};

// Called with mu held (or from the constructor). Retries with backoff until
// connect_timeout, so that clients may start before the server.
void TcpStore::Impl::connect() {
  auto deadline = store::deadline_after(opts.connect_timeout);
  thread_local std::minstd_rand rng{std::random_device{}()};
  Millis backoff = kFirstBackoff;
  std::string why;
  for (int attempt = 1;; ++attempt) {
    net::Fd s = net::connect_once(opts.host, port, deadline, &why);
    if (s.valid() && handshake(s, deadline, &why)) {
      fd = std::move(s);
      COHORT_INFO(kStore, "store client connected to {} (attempt {})", where, attempt);
      return;
    }
    if (deadline.passed())
      throw IoError(fmt::format(
          "cannot reach the store server at {}: {} attempts in {} ms, last error: {}; HINT: check MASTER_ADDR and "
          "MASTER_PORT, that the process hosting the store (rank 0 or the launcher) is running, and that no firewall "
          "blocks the port; if the server starts late, raise the connect timeout",
          where, attempt, opts.connect_timeout.count(), why));
    // Jitter spreads the retries of many ranks that started together.
    Millis pause = backoff + Millis(std::uniform_int_distribution<int64_t>(0, backoff.count() / 2)(rng));
    std::this_thread::sleep_for(std::min<Millis>(pause, Millis(deadline.remaining_ms())));
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

// False (with *why) for failures worth retrying; throws when the server refused us.
bool TcpStore::Impl::handshake(net::Fd& s, core::Deadline deadline, std::string* why) {
  int err = 0;
  size_t got = 0;
  uint8_t challenge[store::kChallengeBytes];
  IoStatus st = net::recv_all(s.get(), challenge, sizeof(challenge), deadline, &err, &got);
  store::Nonce nonce{};
  uint16_t server_version = 0;
  if (st == IoStatus::Ok && !store::decode_challenge(challenge, sizeof(challenge), &nonce, &server_version))
    throw IoError(fmt::format("{} is not a cohort store server (its first bytes are not a store challenge); "
                              "HINT: check MASTER_PORT: another service listens there", where));
  if (st == IoStatus::Ok && server_version != store::kVersion)
    throw IoError(fmt::format("store server {} speaks store protocol version {}, this client {}; HINT: run the same "
                              "cohort version in every process", where, server_version, store::kVersion));
  Bytes hello;
  if (st == IoStatus::Ok) hello = store::encode_hello(secret, nonce);
  uint8_t w[store::kWelcomeBytes];
  if (st == IoStatus::Ok) st = net::send_all(s.get(), hello.data(), hello.size(), deadline, &err);
  if (st == IoStatus::Ok) st = net::recv_all(s.get(), w, sizeof(w), deadline, &err, &got);
  if (st != IoStatus::Ok) {
    *why = st == IoStatus::Timeout  ? "no answer to the handshake"
           : st == IoStatus::Closed ? "the server closed the connection during the handshake"
                                    : "handshake failed: " + net::errno_text(err);
    return false;
  }
  store::Reader r(w, sizeof(w));
  uint32_t magic = r.u32();
  uint16_t version = r.u16();
  auto status = static_cast<store::WelcomeStatus>(r.u16());
  if (magic != store::kMagic)
    throw IoError(fmt::format("{} is not a cohort store server (it answered the handshake with other bytes); "
                              "HINT: check MASTER_PORT: another service listens there", where));
  if (status == store::WelcomeStatus::BadSecret)
    throw IoError(fmt::format("store server {} refused this client: the secret did not match (the job secret, "
                              "COHORT_SECRET / COHORT_SECRET_FILE / COHORT_STORE_SECRET, differs between this process "
                              "and the server); HINT: give every process of the job the same COHORT_SECRET, or unset "
                              "it everywhere", where));
  if (status != store::WelcomeStatus::Ok)
    throw IoError(fmt::format("store server {} refused this client: it speaks store protocol version {}, this client "
                              "{}; HINT: run the same cohort version in every process", where, version, store::kVersion));
  return true;
}

// Reads n bytes of a response. When the deadline passes during a GET/WAIT,
// sends CANCEL once and keeps reading under kCancelGrace.
void TcpStore::Impl::receive(uint8_t* p, size_t n, const Request& req, Millis timeout, core::Deadline* deadline,
                             bool* cancelled) {
  bool cancellable = req.op == Op::Get || req.op == Op::Wait;
  size_t have = 0;
  for (;;) {
    int err = 0;
    size_t got = 0;
    IoStatus st = net::recv_all(fd.get(), p + have, n - have, *deadline, &err, &got);
    have += got;
    if (st == IoStatus::Ok) return;
    if (st != IoStatus::Timeout || !cancellable || *cancelled) fail(st, err, req, "waiting for the reply", timeout);
    *cancelled = true;
    *deadline = store::deadline_after(kCancelGrace);
    Bytes cancel = store::encode_request(Request{.op = Op::Cancel});
    st = net::send_all(fd.get(), cancel.data(), cancel.size(), *deadline, &err);
    if (st != IoStatus::Ok) fail(st, err, req, "cancelling after the timeout", timeout);
  }
}

Response TcpStore::Impl::call(const Request& req, Millis timeout) {
  Bytes frame = store::encode_request(req);
  if (frame.size() - 4 > max_frame)
    throw InvalidArgument(fmt::format(
        "store {}: the request takes {} bytes, over COHORT_STORE_MAX_FRAME={}; HINT: the store is for rendezvous "
        "data: put large data in a file and store its path, or raise COHORT_STORE_MAX_FRAME in every process",
        describe(req), frame.size() - 4, max_frame));
  std::lock_guard<std::mutex> g(mu);
  if (!fd.valid()) connect();
  auto deadline = store::deadline_after(timeout);
  int err = 0;
  IoStatus st = net::send_all(fd.get(), frame.data(), frame.size(), deadline, &err);
  if (st != IoStatus::Ok) fail(st, err, req, "sending the request", timeout);
  bool cancelled = false;
  uint8_t header[4];
  receive(header, 4, req, timeout, &deadline, &cancelled);
  uint32_t len = store::load_le32(header);
  std::string why;
  Response resp;
  if (len == 0 || len > max_frame) {
    why = fmt::format("its length is {} bytes (limit COHORT_STORE_MAX_FRAME={})", len, max_frame);
  } else {
    Bytes body(len);
    receive(body.data(), len, req, timeout, &deadline, &cancelled);
    if (store::decode_response(req.op, body.data(), len, &resp, &why) && resp.status == store::Status::Cancelled &&
        !cancelled)
      why = "it says cancelled, but nothing was";
  }
  if (!why.empty()) {
    fd.reset();
    throw IoError(fmt::format("store server {} sent a malformed reply to {}: {}; HINT: run the same cohort version in "
                              "every process; the connection was reset", where, describe(req), why));
  }
  if (resp.status == store::Status::Error) throw InvalidArgument(fmt::format("{} (store {})", resp.message, where));
  return resp;
}

// Closes the connection (the stream is at an unknown place) and throws.
void TcpStore::Impl::fail(IoStatus st, int err, const Request& req, const char* phase, Millis timeout) {
  fd.reset();
  if (st == IoStatus::Timeout)
    throw TimeoutError(fmt::format(
        "store {} on {} timed out after {} ms while {}; HINT: the server is reachable but not answering (overloaded, "
        "or its process stopped?); the connection was reset and the next call reconnects",
        describe(req), where, timeout.count(), phase));
  if (st == IoStatus::Closed)
    throw IoError(fmt::format(
        "store server {} closed the connection during {} ({}); HINT: the process hosting the store (rank 0 or the "
        "launcher) has probably exited or crashed; look at its log first",
        where, describe(req), phase));
  throw IoError(fmt::format("store {} on {} failed while {}: {}; HINT: check the network between this host and the "
                            "store server", describe(req), where, phase, net::errno_text(err)));
}

TcpStore::TcpStore(TcpStoreOptions opts) : impl_(std::make_unique<Impl>()) {
  timeout_ = opts.timeout;
  impl_->port = opts.port;
  if (opts.is_server) {
    impl_->server = std::make_unique<TcpStoreServer>(opts.server_host, opts.port);
    impl_->port = impl_->server->port();
  }
  impl_->where = net::host_port(opts.host, impl_->port);
  impl_->opts = std::move(opts);
  std::lock_guard<std::mutex> g(impl_->mu);
  impl_->connect();
}

TcpStore::~TcpStore() = default;

uint16_t TcpStore::port() const { return impl_->port; }

void TcpStore::set(const std::string& key, const Bytes& value) {
  impl_->call(Request{.op = Op::Set, .keys = {key}, .value = value}, timeout_);
}

Bytes TcpStore::get(const std::string& key, Millis timeout) {
  Response r = impl_->call(Request{.op = Op::Get, .keys = {key}}, timeout);
  if (r.status == store::Status::Cancelled)
    throw TimeoutError(store::wait_timeout_message("get", {key}, r.missing, timeout, impl_->where));
  return std::move(r.value);
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  return impl_->call(Request{.op = Op::Add, .keys = {key}, .delta = delta}, timeout_).number;
}

Bytes TcpStore::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  return impl_->call(Request{.op = Op::CompareSet, .keys = {key}, .value = desired, .expected = expected}, timeout_).value;
}

void TcpStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  Response r = impl_->call(Request{.op = Op::Wait, .keys = keys}, timeout);
  if (r.status == store::Status::Cancelled)
    throw TimeoutError(store::wait_timeout_message("wait", keys, r.missing, timeout, impl_->where));
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  return impl_->call(Request{.op = Op::Check, .keys = keys}, timeout_).flag;
}

bool TcpStore::delete_key(const std::string& key) {
  return impl_->call(Request{.op = Op::Delete, .keys = {key}}, timeout_).flag;
}

int64_t TcpStore::num_keys() { return impl_->call(Request{.op = Op::NumKeys}, timeout_).number; }

}  // namespace cohort
