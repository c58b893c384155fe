// OpDesc: one collective or point-to-point call as the group queues it, and
// the argument checks every backend runs before queueing (on the caller's
// thread, so that bad arguments throw at the call, not later in wait()).
#pragma once

#include <span>
#include <string>
#include <vector>

#include "cohort/process_group.hpp"
#include "collectives/tuner.hpp"

namespace cohort::group {

// allreduce_gathered's pieces: check_pieces throws InvalidArgument unless they
// lie inside buf, sorted by offset, without overlap (core::copy_pieces copies them in).
void check_pieces(Buffer buf, std::span<const InputPiece> pieces);

struct OpDesc {
  collectives::Coll coll;
  Buffer send;
  Buffer recv;
  ReduceOp op = ReduceOp::Sum;
  int root = 0;   // broadcast, reduce, gather, scatter
  int peer = -1;  // send, recv
  int tag = 0;
  Millis timeout{0};
  uint64_t seq = 0;  // set when queued
  std::vector<P2POp> batch;  // P2PBatch only
  int64_t queued_ns = 0;     // timeline: when it entered the queue (0: ran inline or timeline off)
  const char* algo = nullptr;  // timeline: the algorithm that ran it (set by the group)
  std::vector<InputPiece> pieces;  // allreduce_gathered: input elements still outside the buffer

  // Bytes this rank moves, for the inline-path threshold and messages.
  size_t bytes() const;
  // "allreduce #12 (f32 x 1024, sum)"
  std::string describe() const;

  // What identifies the call on every rank: its element count (in nccl-tests'
  // sense per collective) and a fingerprint of collective, dtype, op and root.
  // Both travel in every message (MsgKey count and tag).
  uint64_t call_count() const;
  uint32_t fingerprint() const;
};

// "broadcast #3 (f32 x 64, root 1)" from what a message carried.
std::string describe_call(uint64_t seq, uint32_t fingerprint, uint64_t count);

// Throws InvalidArgument naming the call, what was wrong and how to fix it.
void validate(const OpDesc& d, int rank, int size);

}  // namespace cohort::group
