// /proc/net/dev reader (net_dev.hpp).
#include "core/net_dev.hpp"

#include <fstream>
#include <sstream>

namespace cohort::core {

// "  eth0: 1234 5 0 0 0 0 0 0 5678 9 ..." : the first number is received
// bytes, the ninth transmitted bytes (the two header lines have no ':' field
// followed by numbers and are skipped).
std::map<std::string, NetCounters> parse_net_dev(const std::string& text) {
  std::map<std::string, NetCounters> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string name = line.substr(0, colon);
    name.erase(0, name.find_first_not_of(' '));
    std::istringstream nums(line.substr(colon + 1));
    uint64_t v[9];
    bool ok = true;
    for (auto& x : v) ok = ok && static_cast<bool>(nums >> x);
    if (!ok || name.empty() || name.find('|') != std::string::npos) continue;
    out[name] = NetCounters{v[0], v[8]};
  }
  return out;
}

std::map<std::string, NetCounters> read_net_dev() {
  std::ifstream f("/proc/net/dev");
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_net_dev(ss.str());
}

}  // namespace cohort::core
