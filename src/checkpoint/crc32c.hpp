// CRC32C internals, exposed so tests can check the hardware and table paths agree.
// The public entry point is cohort::crc32c (cohort/checkpoint.hpp), which picks one.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cohort::ckpt {

// Table-driven, eight bytes per step ("slicing by 8"); any CPU.
uint32_t crc32c_portable(const void* data, size_t n, uint32_t crc);
// True if this CPU has the SSE4.2 crc32 instruction (x86-64 only).
bool crc32c_hardware_available();
// The SSE4.2 path; call only if crc32c_hardware_available().
uint32_t crc32c_hardware(const void* data, size_t n, uint32_t crc);

}  // namespace cohort::ckpt
