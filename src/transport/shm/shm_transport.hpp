// Shared-memory transport: ranks on one host exchange messages through FIFOs
// of slots in one segment per (run, group, host).
//
// Segment: a header (abort record), one control block per local rank (pid,
// doorbell futex word, sleeping flag), then one FIFO per ordered pair of local
// ranks. A FIFO is nslots slots; a slot is a 64-byte header line (ready counter,
// message key, offsets, and up to 16 bytes of inline payload, so a small
// message is one cache line) followed by slot_bytes of payload.
//
// Sender: waits for a free slot (tail), fills it, publishes it with a release
// store of its ready counter, and rings the receiver's doorbell only if the
// receiver said it is asleep. Receiver: polls the next slot's ready counter,
// checks the header against the message it expects, hands the payload to its
// sink (copy or reduce straight out of the slot), and advances tail.
//
// Lifetime: the lowest local rank creates /dev/shm/cohort-<run>-<group>-<leader>;
// once every local rank has mapped it, it is unlinked, so a crash leaves nothing
// behind (the launcher also removes /dev/shm/cohort-<run>-* at exit: launch/run_id.hpp).
//
// Single copy: besides the FIFOs, a rank may read a peer's memory directly
// with process_vm_readv (Linux cross-memory attach), one copy instead of two
// through a slot, and without the peer's thread taking part. Large allreduces
// use it (collectives/allreduce_single_copy.cpp). Every rank allows it with
// prctl(PR_SET_PTRACER_ANY) where Yama asks for that, and open() probes every
// pair; if any pair fails, no rank uses it and the log says why.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "cohort/store.hpp"
#include "core/clock.hpp"
#include "transport/transport.hpp"

namespace cohort::transport {

struct ShmOptions {
  std::string name;              // segment name without the leading '/'
  std::vector<int> local_ranks;  // group ranks on this host, ascending
  int my_rank = 0;               // this rank's group rank (one of local_ranks)
  size_t slot_bytes = 0;         // 0: COHORT_SHM_SLOT_BYTES
  size_t nslots = 0;             // 0: COHORT_SHM_NSLOTS
  bool single_copy = true;       // probe for single copy (false: this rank opts out, and so the whole segment)
};

class ShmTransport : public Waiter {
 public:
  // Creates or attaches the segment, synchronising the local ranks through
  // `store` (keys under "shm/"). Throws IoError (with a hint about /dev/shm
  // space) or TimeoutError naming the local ranks that never attached.
  static std::unique_ptr<ShmTransport> open(const ShmOptions& opts, Store& store, core::Deadline deadline);
  ~ShmTransport() override;

  // A connection to another local rank (group rank).
  std::unique_ptr<Connection> connect(int peer_rank);

  // True when every local rank can read every other local rank's memory with
  // process_vm_readv (probed once at open: Yama's ptrace_scope, seccomp or a
  // container can forbid it); the same answer on every local rank.
  // Connection::read_remote then works on every connection of this transport.
  bool single_copy() const;
  // Why single copy is off ("" when it is on).
  const std::string& single_copy_unavailable_reason() const;

  uint32_t prepare_sleep() override;
  void sleep(uint32_t token, int timeout_us) override;
  void finish_sleep() override;

  struct Impl;

 private:
  explicit ShmTransport(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace cohort::transport
