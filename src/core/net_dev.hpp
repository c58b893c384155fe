// Bytes per network interface from /proc/net/dev (cumulative since boot, or
// since the network namespace was made).
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace cohort::core {

struct NetCounters {
  uint64_t rx_bytes = 0, tx_bytes = 0;
};

// Parses the text of /proc/net/dev; lines that do not parse are skipped.
std::map<std::string, NetCounters> parse_net_dev(const std::string& text);
// Reads /proc/net/dev (empty when it cannot be read).
std::map<std::string, NetCounters> read_net_dev();

}  // namespace cohort::core
