// The relation matrix of `cohort topo`, in the spirit of `nvidia-smi topo -m`:
// for every pair of endpoints (NUMA nodes, NICs, GPUs), how far data travels
// between them. Pure functions over Locality, so tests can use made-up hosts.
//
// The rule, from near to far:
//   NODE  both sides sit on exactly one NUMA node, the same one;
//   PKG   otherwise, all their CPUs lie in one package (sub-NUMA clustering,
//         or a device attached to a whole package);
//   SYS   otherwise: their CPUs span packages, so traffic may cross the
//         inter-socket link (UPI, Infinity Fabric);
//   ?     one side has no known NUMA node (hwloc could not place it).
#include <cstdio>
#include <set>

#include "topo/topology.hpp"

namespace cohort::topo {

const char* relation_symbol(Relation r) {
  switch (r) {
    case Relation::Self: return "X";
    case Relation::SameNuma: return "NODE";
    case Relation::SamePackage: return "PKG";
    case Relation::CrossPackage: return "SYS";
    case Relation::Unknown: return "?";
  }
  return "?";
}

const char* relation_meaning(Relation r) {
  switch (r) {
    case Relation::Self: return "self";
    case Relation::SameNuma: return "same NUMA node: memory and device are local to the same CPUs";
    case Relation::SamePackage: return "different NUMA nodes (or a spread over several) inside one package";
    case Relation::CrossPackage: return "different packages: traffic crosses the inter-socket link (UPI, Infinity Fabric)";
    case Relation::Unknown: return "unknown: hwloc could not tell where the device is attached";
  }
  return "?";
}

Relation relate(const Locality& a, const Locality& b) {
  if (a.numa_nodes.empty() || b.numa_nodes.empty()) return Relation::Unknown;
  if (a.numa_nodes.size() == 1 && a.numa_nodes == b.numa_nodes) return Relation::SameNuma;
  if (a.packages.empty() || b.packages.empty()) return Relation::Unknown;
  std::set<int> pkgs(a.packages.begin(), a.packages.end());
  pkgs.insert(b.packages.begin(), b.packages.end());
  return pkgs.size() == 1 ? Relation::SamePackage : Relation::CrossPackage;
}

Matrix relation_matrix(const Topology& t) {
  Matrix m;
  for (const auto& n : t.numa_nodes) {
    m.labels.push_back("NUMA" + std::to_string(n.os >= 0 ? n.os : n.logical));
    m.localities.push_back(n.locality);
  }
  for (size_t i = 0; i < t.nics.size(); ++i) {
    m.labels.push_back("NIC" + std::to_string(i));
    m.localities.push_back(t.nics[i].locality);
  }
  for (size_t i = 0; i < t.gpus.size(); ++i) {
    m.labels.push_back("GPU" + std::to_string(i));
    m.localities.push_back(t.gpus[i].locality);
  }
  size_t n = m.labels.size();
  m.cells.assign(n, std::vector<Relation>(n, Relation::Unknown));
  for (size_t r = 0; r < n; ++r)
    for (size_t c = 0; c < n; ++c)
      m.cells[r][c] = r == c ? Relation::Self : relate(m.localities[r], m.localities[c]);
  return m;
}

std::string human_bytes(std::uint64_t bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  // Whole numbers print without a decimal: "32 KiB", not "32.0 KiB".
  if (u == 0 || v == static_cast<double>(static_cast<std::uint64_t>(v)))
    std::snprintf(buf, sizeof buf, "%.0f %s", v, units[u]);
  else
    std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  return buf;
}

}  // namespace cohort::topo
