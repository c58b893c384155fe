#include "transport/tcp/tcp_hello.hpp"

#include <cstring>

#include "core/sha256.hpp"

namespace cohort::transport::tcp_hello {
namespace {

void put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void put64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t get32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
         static_cast<uint32_t>(p[3]) << 24;
}
uint64_t get64(const uint8_t* p) {
  return static_cast<uint64_t>(get32(p)) | static_cast<uint64_t>(get32(p + 4)) << 32;
}

core::Digest proof(std::string_view secret, const Nonce& nonce, const HelloFields& f) {
  static constexpr char kContext[] = "cohort-tcp-v2";
  constexpr size_t kCtx = sizeof(kContext) - 1;
  uint8_t msg[kCtx + kNonceBytes + 16];
  std::memcpy(msg, kContext, kCtx);
  std::memcpy(msg + kCtx, nonce.data(), kNonceBytes);
  put64(msg + kCtx + kNonceBytes, f.group_hash);
  put32(msg + kCtx + kNonceBytes + 8, static_cast<uint32_t>(f.rank));
  put32(msg + kCtx + kNonceBytes + 12, f.socket);
  return core::hmac_sha256(secret, msg, sizeof(msg));
}

}  // namespace

const char* verdict_text(Verdict v) {
  switch (v) {
    case Verdict::Ok:
      return "ok";
    case Verdict::Short:
      return "a short or missing handshake";
    case Verdict::BadMagic:
      return "not a cohort handshake (bad magic)";
    case Verdict::BadVersion:
      return "another handshake version (run the same cohort everywhere)";
    case Verdict::BadProof:
      return "a wrong job secret (the proof does not match COHORT_SECRET)";
  }
  return "?";
}

Nonce make_nonce() {
  Nonce n;
  core::random_bytes(n.data(), n.size());
  return n;
}

std::array<uint8_t, kChallengeBytes> encode_challenge(const Nonce& nonce) {
  std::array<uint8_t, kChallengeBytes> out{};
  put32(out.data(), kChallengeMagic);
  put32(out.data() + 4, kVersion);
  std::memcpy(out.data() + 8, nonce.data(), kNonceBytes);
  return out;
}

Verdict check_challenge(const uint8_t* data, size_t n, Nonce* nonce) {
  if (n < 8) return Verdict::Short;
  if (get32(data) != kChallengeMagic) return Verdict::BadMagic;
  if (get32(data + 4) != kVersion) return Verdict::BadVersion;
  if (n != kChallengeBytes) return Verdict::Short;
  std::memcpy(nonce->data(), data + 8, kNonceBytes);
  return Verdict::Ok;
}

std::array<uint8_t, kHelloBytes> encode_hello(std::string_view secret, const Nonce& nonce, const HelloFields& f) {
  std::array<uint8_t, kHelloBytes> out{};
  put32(out.data(), kHelloMagic);
  put32(out.data() + 4, kVersion);
  put64(out.data() + 8, f.group_hash);
  put32(out.data() + 16, static_cast<uint32_t>(f.rank));
  put32(out.data() + 20, f.socket);
  core::Digest d = proof(secret, nonce, f);
  std::memcpy(out.data() + 24, d.data(), d.size());
  return out;
}

Verdict check_hello(const uint8_t* data, size_t n, std::string_view secret, const Nonce& nonce, HelloFields* f) {
  if (n < 8) return Verdict::Short;
  if (get32(data) != kHelloMagic) return Verdict::BadMagic;
  if (get32(data + 4) != kVersion) return Verdict::BadVersion;
  if (n != kHelloBytes) return Verdict::Short;
  f->group_hash = get64(data + 8);
  f->rank = static_cast<int32_t>(get32(data + 16));
  f->socket = get32(data + 20);
  core::Digest want = proof(secret, nonce, *f);
  return core::equal_digests(want.data(), data + 24, want.size()) ? Verdict::Ok : Verdict::BadProof;
}

}  // namespace cohort::transport::tcp_hello
