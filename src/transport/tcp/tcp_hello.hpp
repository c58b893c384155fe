// The TCP transport's handshake: a challenge-response on the job secret
// (core/job_secret.hpp), so that only ranks of this job can open a connection
// that the transport will read from or write to. Pure encode / check functions
// (tcp_setup.cpp does the socket I/O; the fuzzer and the tests call these).
//
//   Challenge  acceptor -> connector: u32 magic "CHAL", u32 version, 16 random bytes (nonce)
//   Hello      connector -> acceptor: u32 magic "HELO", u32 version, u64 group hash,
//                                     i32 rank, u32 socket index,
//                                     32 bytes HMAC-SHA256(secret, "cohort-tcp-v2" || nonce ||
//                                                          group hash || rank || socket index)
//
// All integers little-endian; both messages have a fixed size, so nothing is
// allocated from what a peer claims. The acceptor closes (and logs) a
// connection whose Hello is short, has another magic or version, a bad proof,
// or names a rank or socket it does not expect.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace cohort::transport::tcp_hello {

constexpr uint32_t kChallengeMagic = 0x4c414843;  // "CHAL"
constexpr uint32_t kHelloMagic = 0x4f4c4548;      // "HELO"
constexpr uint32_t kVersion = 2;
constexpr size_t kNonceBytes = 16;
constexpr size_t kChallengeBytes = 8 + kNonceBytes;
constexpr size_t kHelloBytes = 8 + 8 + 4 + 4 + 32;

using Nonce = std::array<uint8_t, kNonceBytes>;

struct HelloFields {
  uint64_t group_hash = 0;
  int32_t rank = -1;
  uint32_t socket = 0;
};

enum class Verdict { Ok, Short, BadMagic, BadVersion, BadProof };
const char* verdict_text(Verdict v);  // "bad magic", ...

Nonce make_nonce();
std::array<uint8_t, kChallengeBytes> encode_challenge(const Nonce& nonce);
Verdict check_challenge(const uint8_t* data, size_t n, Nonce* nonce);

std::array<uint8_t, kHelloBytes> encode_hello(std::string_view secret, const Nonce& nonce, const HelloFields& f);
// Fills *f (even when the proof is bad, for the log) when the size, magic and version are right.
Verdict check_hello(const uint8_t* data, size_t n, std::string_view secret, const Nonce& nonce, HelloFields* f);

}  // namespace cohort::transport::tcp_hello
