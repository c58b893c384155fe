// Clock alignment for timelines (pure parts; the store exchange is in
// group/timeline_setup.cpp).
//
// Every rank stamps events with its host's steady clock (CLOCK_MONOTONIC).
// Ranks on one host share that clock: same /proc/sys/kernel/random/boot_id
// means offset 0. Ranks on another host measure their offset to rank 0 by
// ping-pong through the store: send at t_send (local), rank 0 answers with its
// clock t_remote, the answer arrives at t_recv (local). If the two legs take
// equally long, rank 0's clock read t_remote at local (t_send + t_recv) / 2;
// the error is at most half the round trip, so the round with the shortest
// round trip wins.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace cohort::core {

struct PingSample {
  int64_t t_send_ns;    // local clock when the ping left
  int64_t t_remote_ns;  // rank 0's clock when it answered
  int64_t t_recv_ns;    // local clock when the answer arrived
};

struct ClockOffset {
  int64_t offset_ns = 0;  // add to a local time to get rank 0's time
  int64_t error_ns = 0;   // bound: half the best round trip
};

// Throws InvalidArgument on an empty list.
ClockOffset estimate_offset(const std::vector<PingSample>& samples);

// This boot's id ("" if the file cannot be read: then no host is "the same").
std::string boot_id();

}  // namespace cohort::core
