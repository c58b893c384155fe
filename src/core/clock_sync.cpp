// Clock offset estimation (clock_sync.hpp).
#include "core/clock_sync.hpp"

#include <fstream>

#include "cohort/error.hpp"

namespace cohort::core {

ClockOffset estimate_offset(const std::vector<PingSample>& samples) {
  if (samples.empty()) throw InvalidArgument("estimate_offset: no ping samples; HINT: ping rank 0 at least once");
  const PingSample* best = &samples[0];
  for (const auto& s : samples)
    if (s.t_recv_ns - s.t_send_ns < best->t_recv_ns - best->t_send_ns) best = &s;
  const int64_t rtt = best->t_recv_ns - best->t_send_ns;
  const int64_t local_mid = best->t_send_ns + rtt / 2;
  return ClockOffset{best->t_remote_ns - local_mid, rtt / 2};
}

std::string boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

}  // namespace cohort::core
