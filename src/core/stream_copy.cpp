#include "core/stream_copy.hpp"

#include <algorithm>
#include <cstdint>
#include <cstddef>
#include <cstring>
#include <fstream>
#include <string>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace cohort::core {

#if defined(__x86_64__)
namespace {
// The largest cache of cpu0 as the kernel reports it (sysfs), 0 when unknown.
// Not sysconf(_SC_LEVEL3_CACHE_SIZE): glibc reads cpuid its own way and says
// 320 MiB on the project's VM, where the kernel (and lscpu) say 32 MiB.
size_t last_level_cache() {
  size_t best = 0;
  for (int i = 0; i < 8; ++i) {
    std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/size");
    size_t v = 0;
    std::string unit;
    if (!(f >> v)) continue;
    f >> unit;  // "32768K"
    if (unit == "K") v <<= 10;
    else if (unit == "M") v <<= 20;
    best = std::max(best, v);
  }
  return best;
}
}  // namespace
#endif

size_t stream_copy_min() {
#if defined(__x86_64__)
  static const size_t min = [] {
    const size_t llc = last_level_cache();
    return llc == 0 ? size_t{16} << 20 : std::clamp(llc / 2, size_t{4} << 20, size_t{32} << 20);
  }();
  return min;
#else
  return SIZE_MAX;
#endif
}

void stream_copy(void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  // Streaming stores need a 16-byte aligned destination: the head up to it
  // goes by memcpy, then 64 bytes (a cache line) per step, then the tail.
  const size_t head = std::min(n, (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15);
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  const size_t body = n & ~size_t{63};
  for (size_t i = 0; i < body; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + body, s + body, n - body);
#else
  std::memcpy(dst, src, n);
#endif
}

void stream_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

}  // namespace cohort::core
