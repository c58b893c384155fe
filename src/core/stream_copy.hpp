// Copies that bypass the cache, for the large one-way copies of the
// single-copy collectives (a block written into a peer's buffer, which this
// process does not read again).
//
// An ordinary store first reads the destination's cache line (read for
// ownership), so memcpy of B bytes out of cache moves about 3B through
// memory: B read, B read for ownership, B written back. Non-temporal stores
// write whole lines straight to memory: 2B. On this project's 2-core VM (AMD
// EPYC, 32 MiB L3) a 32 MiB memcpy runs at 7-9 GB/s and the streaming copy
// at 10-14 GB/s; one source written to two destinations is 2.5x faster than
// two memcpys.
//
// But the stores evict the destination from the cache: when the data a call
// touches fits in the cache (a benchmark's loop, a small bucket reused every
// step), memcpy is faster. Callers use stream_copy when the bytes the whole
// call writes reach stream_copy_min().
//
// Ordering: non-temporal stores are weakly ordered (x86). Call stream_fence()
// after the last stream_copy and before telling another process the data is
// there (a release store, a message): the fence makes them visible first.
// Architectures other than x86-64 get memcpy and an empty fence.
#pragma once

#include <cstddef>

namespace cohort::core {

// Half the last-level cache (as sysfs gives it), from 4 to 32 MiB; 16 MiB
// when the system does not say. Measured on the AMD VM (32 MiB L3; a 2-rank
// allgather, docs/algorithms.md): streaming wins from 16 MiB of output up.
// Capped because a guest sees the host's whole L3, shared with other guests:
// the Intel VM reports 480 MiB, and there streaming already wins at 64 MiB
// (7.2 against 4.3 GB/s busbw with memcpy) and is even at 32. SIZE_MAX where
// there are no streaming stores (not x86-64): callers then never prefer them.
size_t stream_copy_min();

// memcpy(dst, src, n) with non-temporal stores on x86-64. The ranges must not
// overlap.
void stream_copy(void* dst, const void* src, size_t n);

// Orders every earlier stream_copy before later stores (x86-64: sfence).
void stream_fence();

}  // namespace cohort::core
