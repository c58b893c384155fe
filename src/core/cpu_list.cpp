#include "core/cpu_layout.hpp"

#include <sched.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <fmt/format.h>

namespace cohort::core {
namespace {

std::optional<std::string> read_line(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  if (!f || !std::getline(f, line)) return std::nullopt;
  return line;
}

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

CpuLayout read_cpu_layout(const std::string& root) {
  namespace fs = std::filesystem;
  CpuLayout l;
  if (auto line = read_line(root + "/cpu/online"))
    if (auto v = parse_cpu_list(*line)) l.online = *v;
  if (l.online.empty()) l.online = current_affinity();

  std::map<int, CpuList> nodes;
  std::error_code ec;
  for (fs::directory_iterator it(root + "/node", ec), end; !ec && it != end; it.increment(ec)) {
    std::string name = it->path().filename().string();
    if (name.rfind("node", 0) != 0) continue;
    auto id = parse_int(name.substr(4));
    if (!id) continue;
    auto line = read_line(it->path().string() + "/cpulist");
    if (!line) continue;
    auto v = parse_cpu_list(*line);
    if (v && !v->empty()) nodes[*id] = *v;  // memory-only nodes hold no CPU to bind to
  }
  if (nodes.empty()) nodes[0] = l.online;
  for (auto& [id, cpus] : nodes) {
    l.numa_ids.push_back(id);
    l.numa.push_back(cpus);
  }

  // Physical cores: CPUs sharing a thread_siblings_list are one core.
  std::set<CpuList> cores;
  for (int cpu : l.online) {
    auto line = read_line(fmt::format("{}/cpu/cpu{}/topology/thread_siblings_list", root, cpu));
    std::optional<CpuList> v = line ? parse_cpu_list(*line) : std::nullopt;
    cores.insert(v && !v->empty() ? *v : CpuList{cpu});
  }
  l.cores.assign(cores.begin(), cores.end());
  std::sort(l.cores.begin(), l.cores.end(), [](const CpuList& a, const CpuList& b) { return a.front() < b.front(); });
  return l;
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

std::string describe_host_cpus(const CpuLayout& l, const CpuList& affinity) {
  std::string nodes;
  for (size_t i = 0; i < l.numa.size(); ++i)
    nodes += fmt::format("{}node{}: {}", i ? ", " : "", l.numa_ids[i], cpu_list_text(l.numa[i]));
  return fmt::format("{} CPU(s) online ({}), {} core(s), {} NUMA node(s) ({}); this process may run on CPUs {}",
                     l.online.size(), cpu_list_text(l.online), l.cores.size(), l.numa.size(), nodes,
                     cpu_list_text(affinity));
}

}  // namespace cohort::core
