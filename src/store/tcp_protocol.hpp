// store/tcp_protocol.hpp: the TcpStore wire format, as pure encode/decode
// functions that both ends (and the tests) call.
//
// All integers are little-endian. A blob is a u32 length followed by that many
// bytes (keys, values, messages, the secret).
//
// 1. Handshake, once per connection: a challenge-response on the job secret
//    (core/job_secret.hpp), which never crosses the wire.
//      Challenge server -> client: u32 magic "CHST" (0x54534843), u16 version,
//                                  u16 reserved (0), 16 random bytes (the nonce)
//      Hello     client -> server: u32 magic, u16 version, u16 reserved (0),
//                                  32 bytes HMAC-SHA256(secret, "cohort-store-v2" || nonce)
//      Welcome   server -> client: u32 magic, u16 server version, u16 status
//                                  (0 ok, 1 version mismatch, 2 secret mismatch)
//    On a nonzero status the server closes the connection after the Welcome
//    (and logs the refusal). A peer whose first bytes are not the magic is
//    closed without a reply. Nothing but a Hello is read before an ok Welcome,
//    so a client without the secret cannot read or write any key.
//
// 2. Then frames: u32 body length (1 .. COHORT_STORE_MAX_FRAME) + body.
//    request body  = u8 op + arguments
//    response body = u8 status + result (status 0 ok, 1 error, 2 cancelled)
//
//      op              arguments                          ok result
//      1 SET           blob key, blob value               -
//      2 GET           blob key                           blob value  (sent once key exists)
//      3 ADD           blob key, i64 delta                i64 new value
//      4 COMPARE_SET   blob key, blob expected,           blob value now stored
//                      blob desired
//      5 WAIT          u32 n, n blob keys                 -           (sent once all exist)
//      6 CHECK         u32 n, n blob keys                 u8 all exist
//      7 DELETE        blob key                           u8 existed
//      8 NUM_KEYS      -                                  i64 count
//      9 CANCEL        -                                  (no response of its own)
//
//    error result:     blob message (e.g. add() on a key that holds text)
//    cancelled result: u32 n, n blob keys still missing
//
//    A connection carries one request at a time: the client sends the next one
//    only after reading the whole response. The one exception is CANCEL, which
//    a client sends when its GET or WAIT reached its deadline: if that request
//    still waits, the server answers it now with "cancelled" and the missing
//    keys; if its answer is already on the way, the server ignores the CANCEL.
//    Either way the GET/WAIT gets exactly one response and the stream stays in
//    step. Anything else sent while a response is owed is a protocol error.
//
// Every length is checked against the bytes present before anything is
// allocated or copied; a frame that fails to decode closes its connection.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cohort/store.hpp"

namespace cohort::store {

constexpr uint32_t kMagic = 0x54534843;  // "CHST" read as little-endian bytes
constexpr uint16_t kVersion = 2;  // 2: challenge-response (1 sent the secret itself)
constexpr size_t kNonceBytes = 16;
constexpr size_t kChallengeBytes = 8 + kNonceBytes;
constexpr size_t kProofBytes = 32;
constexpr size_t kHelloBytes = 8 + kProofBytes;
constexpr size_t kWelcomeBytes = 8;

enum class Op : uint8_t { Set = 1, Get = 2, Add = 3, CompareSet = 4, Wait = 5, Check = 6, Delete = 7, NumKeys = 8, Cancel = 9 };
enum class Status : uint8_t { Ok = 0, Error = 1, Cancelled = 2 };
enum class WelcomeStatus : uint16_t { Ok = 0, BadVersion = 1, BadSecret = 2 };

const char* op_name(Op op);

inline uint32_t load_le32(const uint8_t* p) {
  return p[0] | p[1] << 8 | p[2] << 16 | static_cast<uint32_t>(p[3]) << 24;
}  // "set", "get", ... as in the Store API

// The job secret (core/job_secret.hpp) and COHORT_STORE_MAX_FRAME (declared in tcp_protocol.cpp).
std::string configured_secret();
uint64_t configured_max_frame();

struct Request {
  Op op = Op::NumKeys;
  std::vector<std::string> keys;  // one for key ops, n for WAIT/CHECK, none for NUM_KEYS/CANCEL
  Bytes value;                    // SET value, COMPARE_SET desired
  Bytes expected;                 // COMPARE_SET
  int64_t delta = 0;              // ADD
};

struct Response {
  Status status = Status::Ok;
  Bytes value;                       // GET, COMPARE_SET
  int64_t number = 0;                // ADD, NUM_KEYS
  bool flag = false;                 // CHECK, DELETE
  std::string message;               // Status::Error
  std::vector<std::string> missing;  // Status::Cancelled
};

// Appends little-endian fields to a byte buffer. begin_frame/end_frame wrap a
// body in its u32 length.
class Writer {
 public:
  explicit Writer(Bytes& out) : out_(out) {}
  void u8(uint8_t v) { out_.push_back(v); }
  void u16(uint16_t v) { le(v, 2); }
  void u32(uint32_t v) { le(v, 4); }
  void i64(int64_t v) { le(static_cast<uint64_t>(v), 8); }
  void blob(const void* data, size_t n);
  void blob(std::string_view s) { blob(s.data(), s.size()); }
  void blob(const Bytes& b) { blob(b.data(), b.size()); }
  size_t begin_frame();           // reserves the length; returns its offset
  void end_frame(size_t offset);  // fills in the length of what followed

 private:
  void le(uint64_t v, int n);
  Bytes& out_;
};

// Reads little-endian fields from a byte range. Every read checks the bytes
// left; after the first failure ok() is false and later reads return zeros.
class Reader {
 public:
  Reader(const uint8_t* data, size_t n) : p_(data), end_(data + n) {}
  uint8_t u8() { return static_cast<uint8_t>(le(1)); }
  uint16_t u16() { return static_cast<uint16_t>(le(2)); }
  uint32_t u32() { return static_cast<uint32_t>(le(4)); }
  int64_t i64() { return static_cast<int64_t>(le(8)); }
  std::string str();
  Bytes bytes();
  bool ok() const { return ok_; }
  size_t left() const { return static_cast<size_t>(end_ - p_); }
  // ok() and every byte consumed: a decoded message must not have a tail.
  bool done() const { return ok_ && p_ == end_; }

 private:
  uint64_t le(int n);
  const uint8_t* take(size_t n);
  const uint8_t* p_;
  const uint8_t* end_;
  bool ok_ = true;
};

using Nonce = std::array<uint8_t, kNonceBytes>;
Nonce make_nonce();  // from the kernel's random source
Bytes encode_challenge(const Nonce& nonce);
// False unless the bytes are a whole Challenge; *version is what the server speaks.
bool decode_challenge(const uint8_t* data, size_t n, Nonce* nonce, uint16_t* version);
Bytes encode_hello(std::string_view secret, const Nonce& nonce);

// The server's verdict on the first bytes a client sent after the Challenge.
// `used` is the Hello's length when the verdict is Ok. BadVersion and
// BadSecret deserve a Welcome saying so; BadMagic is closed without a word.
enum class HelloVerdict { NeedMore, Ok, BadMagic, BadVersion, BadSecret };
struct HelloCheck {
  HelloVerdict verdict = HelloVerdict::NeedMore;
  size_t used = 0;
  uint16_t version = 0;  // what the client speaks (for BadVersion)
};
// Compares the proof in time independent of where it differs.
HelloCheck check_hello(const uint8_t* data, size_t n, std::string_view secret, const Nonce& nonce);
Bytes encode_welcome(WelcomeStatus status);
// A whole frame (length prefix included).
Bytes encode_request(const Request& req);
// `body` is a frame body (no length prefix). On failure returns false and says why.
bool decode_request(const uint8_t* body, size_t n, Request* out, std::string* why);
// The response to a request with this op, as a whole frame.
Bytes encode_response(Op op, const Response& resp);
bool decode_response(Op op, const uint8_t* body, size_t n, Response* out, std::string* why);

}  // namespace cohort::store
