#include "store/tcp_protocol.hpp"

#include <cstring>

#include <fmt/format.h>

#include "core/env.hpp"
#include "core/job_secret.hpp"
#include "core/sha256.hpp"

namespace cohort::store {
namespace {

const core::Knob kMaxFrame{"COHORT_STORE_MAX_FRAME", "256M",
                           "largest TcpStore request or response (bytes; K/M/G suffixes); bigger frames close the "
                           "connection, so one bad peer cannot make the store allocate without bound",
                           core::KnobKind::Bytes};

bool has_key(Op op) {
  return op == Op::Set || op == Op::Get || op == Op::Add || op == Op::CompareSet || op == Op::Delete;
}

}  // namespace

const char* op_name(Op op) {
  switch (op) {
    case Op::Set: return "set";
    case Op::Get: return "get";
    case Op::Add: return "add";
    case Op::CompareSet: return "compare_set";
    case Op::Wait: return "wait";
    case Op::Check: return "check";
    case Op::Delete: return "delete_key";
    case Op::NumKeys: return "num_keys";
    case Op::Cancel: return "cancel";
  }
  return "unknown";
}

std::string configured_secret() { return core::job_secret(); }

uint64_t configured_max_frame() {
  uint64_t v = kMaxFrame.bytes();
  // A u32 carries the length; below 64 bytes no real request fits.
  if (v > 0xffffffffull) v = 0xffffffffull;
  if (v < 64) v = 64;
  return v;
}

void Writer::le(uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out_.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

void Writer::blob(const void* data, size_t n) {
  u32(static_cast<uint32_t>(n));
  const auto* p = static_cast<const uint8_t*>(data);
  out_.insert(out_.end(), p, p + n);
}

size_t Writer::begin_frame() {
  size_t at = out_.size();
  u32(0);
  return at;
}

void Writer::end_frame(size_t offset) {
  uint64_t n = out_.size() - offset - 4;
  for (int i = 0; i < 4; ++i) out_[offset + i] = static_cast<uint8_t>(n >> (8 * i));
}

const uint8_t* Reader::take(size_t n) {
  if (!ok_ || left() < n) {
    ok_ = false;
    return nullptr;
  }
  const uint8_t* p = p_;
  p_ += n;
  return p;
}

uint64_t Reader::le(int n) {
  const uint8_t* p = take(static_cast<size_t>(n));
  if (p == nullptr) return 0;
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

std::string Reader::str() {
  uint32_t n = u32();
  const uint8_t* p = take(n);
  return p ? std::string(reinterpret_cast<const char*>(p), n) : std::string();
}

Bytes Reader::bytes() {
  uint32_t n = u32();
  const uint8_t* p = take(n);
  return p ? Bytes(p, p + n) : Bytes();
}

namespace {

core::Digest hello_proof(std::string_view secret, const Nonce& nonce) {
  static constexpr char kContext[] = "cohort-store-v2";
  uint8_t msg[sizeof(kContext) - 1 + kNonceBytes];
  std::memcpy(msg, kContext, sizeof(kContext) - 1);
  std::memcpy(msg + sizeof(kContext) - 1, nonce.data(), kNonceBytes);
  return core::hmac_sha256(secret, msg, sizeof(msg));
}

}  // namespace

Nonce make_nonce() {
  Nonce n;
  core::random_bytes(n.data(), n.size());
  return n;
}

Bytes encode_challenge(const Nonce& nonce) {
  Bytes out;
  Writer w(out);
  w.u32(kMagic);
  w.u16(kVersion);
  w.u16(0);
  out.insert(out.end(), nonce.begin(), nonce.end());
  return out;
}

bool decode_challenge(const uint8_t* data, size_t n, Nonce* nonce, uint16_t* version) {
  if (n < 8) return false;
  Reader r(data, 8);
  if (r.u32() != kMagic) return false;
  *version = r.u16();
  if (*version != kVersion) return true;  // the caller reports the mismatch
  if (n != kChallengeBytes) return false;
  std::memcpy(nonce->data(), data + 8, kNonceBytes);
  return true;
}

Bytes encode_hello(std::string_view secret, const Nonce& nonce) {
  Bytes out;
  Writer w(out);
  w.u32(kMagic);
  w.u16(kVersion);
  w.u16(0);
  core::Digest proof = hello_proof(secret, nonce);
  out.insert(out.end(), proof.begin(), proof.end());
  return out;
}

HelloCheck check_hello(const uint8_t* data, size_t n, std::string_view secret, const Nonce& nonce) {
  HelloCheck h;
  Reader r(data, n);
  uint32_t magic = r.u32();
  if (!r.ok()) return h;
  if (magic != kMagic) {
    h.verdict = HelloVerdict::BadMagic;
    return h;
  }
  h.version = r.u16();
  if (!r.ok()) return h;
  if (h.version != kVersion) {
    h.verdict = HelloVerdict::BadVersion;
    return h;
  }
  if (n < kHelloBytes) return h;
  core::Digest want = hello_proof(secret, nonce);
  h.verdict = core::equal_digests(want.data(), data + 8, kProofBytes) ? HelloVerdict::Ok : HelloVerdict::BadSecret;
  h.used = kHelloBytes;
  return h;
}

Bytes encode_welcome(WelcomeStatus status) {
  Bytes out;
  Writer w(out);
  w.u32(kMagic);
  w.u16(kVersion);
  w.u16(static_cast<uint16_t>(status));
  return out;
}

Bytes encode_request(const Request& req) {
  Bytes out;
  Writer w(out);
  size_t frame = w.begin_frame();
  w.u8(static_cast<uint8_t>(req.op));
  if (req.op == Op::Wait || req.op == Op::Check) {
    w.u32(static_cast<uint32_t>(req.keys.size()));
    for (const auto& k : req.keys) w.blob(k);
  } else if (has_key(req.op)) {
    w.blob(req.keys.at(0));
  }
  if (req.op == Op::Set) w.blob(req.value);
  if (req.op == Op::Add) w.i64(req.delta);
  if (req.op == Op::CompareSet) {
    w.blob(req.expected);
    w.blob(req.value);
  }
  w.end_frame(frame);
  return out;
}

bool decode_request(const uint8_t* body, size_t n, Request* out, std::string* why) {
  Reader r(body, n);
  uint8_t op = r.u8();
  if (!r.ok() || op < static_cast<uint8_t>(Op::Set) || op > static_cast<uint8_t>(Op::Cancel)) {
    *why = r.ok() ? fmt::format("unknown op {}", op) : "empty frame";
    return false;
  }
  Request req;
  req.op = static_cast<Op>(op);
  if (req.op == Op::Wait || req.op == Op::Check) {
    uint32_t count = r.u32();
    // Each key takes at least its 4-byte length: a count the body cannot hold
    // is rejected before reserving anything.
    if (!r.ok() || count > r.left() / 4) {
      *why = fmt::format("{} claims {} keys in {} bytes", op_name(req.op), count, n);
      return false;
    }
    req.keys.reserve(count);
    for (uint32_t i = 0; i < count && r.ok(); ++i) req.keys.push_back(r.str());
  } else if (has_key(req.op)) {
    req.keys.push_back(r.str());
  }
  if (req.op == Op::Set) req.value = r.bytes();
  if (req.op == Op::Add) req.delta = r.i64();
  if (req.op == Op::CompareSet) {
    req.expected = r.bytes();
    req.value = r.bytes();
  }
  if (!r.done()) {
    *why = fmt::format("{} request of {} bytes is {}", op_name(req.op), n,
                       r.ok() ? "longer than its fields" : "shorter than its fields claim");
    return false;
  }
  *out = std::move(req);
  return true;
}

Bytes encode_response(Op op, const Response& resp) {
  Bytes out;
  Writer w(out);
  size_t frame = w.begin_frame();
  w.u8(static_cast<uint8_t>(resp.status));
  if (resp.status == Status::Error) {
    w.blob(resp.message);
  } else if (resp.status == Status::Cancelled) {
    w.u32(static_cast<uint32_t>(resp.missing.size()));
    for (const auto& k : resp.missing) w.blob(k);
  } else if (op == Op::Get || op == Op::CompareSet) {
    w.blob(resp.value);
  } else if (op == Op::Add || op == Op::NumKeys) {
    w.i64(resp.number);
  } else if (op == Op::Check || op == Op::Delete) {
    w.u8(resp.flag ? 1 : 0);
  }
  w.end_frame(frame);
  return out;
}

bool decode_response(Op op, const uint8_t* body, size_t n, Response* out, std::string* why) {
  Reader r(body, n);
  uint8_t status = r.u8();
  if (!r.ok() || status > static_cast<uint8_t>(Status::Cancelled)) {
    *why = r.ok() ? fmt::format("unknown status {}", status) : "empty frame";
    return false;
  }
  Response resp;
  resp.status = static_cast<Status>(status);
  if (resp.status == Status::Error) {
    resp.message = r.str();
  } else if (resp.status == Status::Cancelled) {
    uint32_t count = r.u32();
    if (!r.ok() || count > r.left() / 4) {
      *why = fmt::format("cancelled reply claims {} keys in {} bytes", count, n);
      return false;
    }
    for (uint32_t i = 0; i < count && r.ok(); ++i) resp.missing.push_back(r.str());
  } else if (op == Op::Get || op == Op::CompareSet) {
    resp.value = r.bytes();
  } else if (op == Op::Add || op == Op::NumKeys) {
    resp.number = r.i64();
  } else if (op == Op::Check || op == Op::Delete) {
    uint8_t f = r.u8();
    if (f > 1) {
      *why = fmt::format("{} reply flag is {}, not 0 or 1", op_name(op), f);
      return false;
    }
    resp.flag = f == 1;
  }
  if (!r.done()) {
    *why = fmt::format("{} reply of {} bytes is {}", op_name(op), n,
                       r.ok() ? "longer than its fields" : "shorter than its fields claim");
    return false;
  }
  *out = std::move(resp);
  return true;
}

}  // namespace cohort::store
