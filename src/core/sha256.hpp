// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for the job secret's
// challenge-response handshakes (store and TCP transport). Small and
// dependency-free; tested against the FIPS 180-4 and RFC 4231 vectors.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace cohort::core {

using Digest = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  void update(std::string_view s) { update(s.data(), s.size()); }
  Digest finish();  // the object is spent afterwards

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buffered_ = 0;
  uint64_t total_ = 0;
};

Digest sha256(const void* data, size_t n);
Digest hmac_sha256(std::string_view key, const void* msg, size_t n);
std::string to_hex(const uint8_t* p, size_t n);
// Compares in time independent of where the inputs differ.
bool equal_digests(const uint8_t* a, const uint8_t* b, size_t n);
// n bytes from the kernel's random source (getrandom); throws IoError if it fails.
void random_bytes(void* out, size_t n);

}  // namespace cohort::core
