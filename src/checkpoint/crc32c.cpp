// CRC32C (Castagnoli): the checksum of every file in a checkpoint manifest.
//
// Why CRC32C: it detects every burst error up to 32 bits and all 1-3 bit errors
// in files far larger than checkpoints, it is the checksum of iSCSI, ext4 metadata
// and LevelDB, and x86-64 computes it in hardware (SSE4.2) at several GB/s, so
// verifying a checkpoint costs little next to reading it. It is not a defence
// against deliberate tampering (no checksum is).
//
// Parameters: reflected polynomial 0x82F63B78, initial value and final xor
// 0xFFFFFFFF. Continuation: crc32c(b, nb, crc32c(a, na)) == crc32c(a || b).
//
// The portable path processes eight bytes per step with eight 256-entry tables:
// table[0] is the classic byte-at-a-time table and table[k][i] is the CRC of byte
// i followed by k zero bytes, so the eight lookups for one 64-bit word can be
// xor'ed together.
#include "checkpoint/crc32c.hpp"

#include <array>
#include <cstring>

#include "cohort/checkpoint.hpp"

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace cohort::ckpt {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;

using Tables = std::array<std::array<uint32_t, 256>, 8>;

constexpr Tables make_tables() {
  Tables t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t[0][i] = c;
  }
  for (int k = 1; k < 8; ++k)
    for (uint32_t i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xff];
  return t;
}

constexpr Tables kTables = make_tables();

uint32_t load_le32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;  // little-endian hosts only (static_assert in safetensors.cpp)
}

}  // namespace

uint32_t crc32c_portable(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint32_t lo = load_le32(p) ^ c;
    uint32_t hi = load_le32(p + 4);
    c = kTables[7][lo & 0xff] ^ kTables[6][(lo >> 8) & 0xff] ^ kTables[5][(lo >> 16) & 0xff] ^
        kTables[4][lo >> 24] ^ kTables[3][hi & 0xff] ^ kTables[2][(hi >> 8) & 0xff] ^
        kTables[1][(hi >> 16) & 0xff] ^ kTables[0][hi >> 24];
  }
  for (; n > 0; --n, ++p) c = (c >> 8) ^ kTables[0][(c ^ *p) & 0xff];
  return ~c;
}

#if defined(__x86_64__)
bool crc32c_hardware_available() {
  static const bool available = __builtin_cpu_supports("sse4.2");
  return available;
}

__attribute__((target("sse4.2"))) uint32_t crc32c_hardware(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t c = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
  }
  auto c32 = static_cast<uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = _mm_crc32_u8(c32, *p);
  return ~c32;
}
#else
bool crc32c_hardware_available() { return false; }
uint32_t crc32c_hardware(const void* data, size_t n, uint32_t crc) { return crc32c_portable(data, n, crc); }
#endif

}  // namespace cohort::ckpt

namespace cohort {

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  return ckpt::crc32c_hardware_available() ? ckpt::crc32c_hardware(data, n, crc)
                                           : ckpt::crc32c_portable(data, n, crc);
}

}  // namespace cohort
