// OpDesc: one collective or point-to-point call as the group queues it, and
// the argument checks every backend runs before queueing (on the caller's
// thread, so that bad arguments throw at the call, not later in wait()).
#pragma once

#include <string>

#include "cohort/process_group.hpp"
#include "collectives/tuner.hpp"

namespace cohort::group {

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

  // Bytes this rank moves, for the inline-path threshold and messages.
  size_t bytes() const;
  // "allreduce #12 (f32 x 1024, sum)"
  std::string describe() const;
};

// Throws InvalidArgument naming the call, what was wrong and how to fix it.
void validate(const OpDesc& d, int rank, int size);

}  // namespace cohort::group
