#include "core/cpu_list.hpp"

#include <sched.h>

#include <unistd.h>

#include <set>
#include <sstream>

#include <fmt/format.h>

namespace cohort::core {
namespace {

std::optional<int> parse_int(const std::string& s) {
  if (s.empty() || s.size() > 6) return std::nullopt;
  for (char c : s)
    if (c < '0' || c > '9') return std::nullopt;
  return std::stoi(s);
}

}  // namespace

std::optional<CpuList> parse_cpu_list(const std::string& raw) {
  std::string text;
  for (char c : raw)
    if (c != ' ' && c != '\n' && c != '\t') text += c;
  std::set<int> cpus;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) return std::nullopt;
    auto dash = item.find('-');
    if (dash == std::string::npos) {
      auto v = parse_int(item);
      if (!v) return std::nullopt;
      cpus.insert(*v);
      continue;
    }
    auto lo = parse_int(item.substr(0, dash)), hi = parse_int(item.substr(dash + 1));
    if (!lo || !hi || *lo > *hi) return std::nullopt;
    for (int c = *lo; c <= *hi; ++c) cpus.insert(c);
  }
  return CpuList(cpus.begin(), cpus.end());
}

std::string cpu_list_text(const CpuList& cpus) {
  if (cpus.empty()) return "none";
  std::string out;
  size_t i = 0;
  while (i < cpus.size()) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += j == i ? std::to_string(cpus[i]) : fmt::format("{}-{}", cpus[i], cpus[j]);
    i = j + 1;
  }
  return out;
}

CpuList current_affinity() {
  cpu_set_t set;
  CPU_ZERO(&set);
  CpuList out;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return out;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) out.push_back(c);
  return out;
}

std::string describe_affinity(const CpuList& affinity) {
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  return fmt::format("{} CPU(s) online; this process may run on CPUs {} (`cohort topo` shows the cores and NUMA nodes)",
                     online, cpu_list_text(affinity));
}

}  // namespace cohort::core
