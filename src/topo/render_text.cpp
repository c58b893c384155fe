// `cohort topo` as text: the hwloc tree (lstopo-like, single-child chains
// joined with " + "), a summary of the counts, the CPU layout --bind uses, the NICs and GPUs, and the
// relation matrix with its legend. docs/observability.md shows an example.
#include <algorithm>
#include <sstream>

#include "topo/topology.hpp"

namespace cohort::topo {
namespace {

std::string plural(int n, const std::string& one, const std::string& many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

// "Package L#0 (P#0)", "NUMANode L#0 (P#0, 15.6 GiB)", "L3 L#0 (32 MiB)".
std::string label(const TreeNode& n) {
  std::string s = n.type;
  if (n.type != "Machine") s += " L#" + std::to_string(n.logical);
  std::vector<std::string> extra;
  if (n.os >= 0 && n.type != "Machine") extra.push_back("P#" + std::to_string(n.os));
  if (n.bytes > 0) extra.push_back(human_bytes(n.bytes) + (n.type == "Machine" ? " total" : ""));
  if (!extra.empty()) {
    s += " (";
    for (size_t i = 0; i < extra.size(); ++i) s += (i ? ", " : "") + extra[i];
    s += ")";
  }
  return s;
}

// A core with its hardware threads on one line: "Core L#0 (P#0): PU L#0 (P#0), PU L#1 (P#2)".
bool is_core_of_pus(const TreeNode& n) {
  return n.type == "Core" && !n.children.empty() &&
         std::all_of(n.children.begin(), n.children.end(), [](const TreeNode& c) { return c.type == "PU"; });
}

void print_tree(std::ostringstream& out, const TreeNode& n, int depth) {
  out << std::string(2 * depth, ' ');
  const TreeNode* cur = &n;
  // Join chains of single children (L3 + L2 + L1d + Core), as lstopo does.
  // The Machine line stays alone: it opens the tree.
  while (true) {
    if (is_core_of_pus(*cur)) {
      out << label(*cur) << ":";
      for (size_t i = 0; i < cur->children.size(); ++i) out << (i ? ", " : " ") << label(cur->children[i]);
      out << "\n";
      return;
    }
    out << label(*cur);
    if (cur->type == "Machine" || cur->children.size() != 1) break;
    cur = &cur->children[0];
    out << " + ";
  }
  out << "\n";
  for (const auto& c : cur->children) print_tree(out, c, depth + 1);
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + v[i];
  return s;
}

std::string numa_list(const Locality& l) {
  if (l.numa_nodes.empty()) return "unknown";
  std::vector<std::string> v;
  for (int n : l.numa_nodes) v.push_back(std::to_string(n));
  return join(v, ",");
}

void print_devices(std::ostringstream& out, const char* title, const char* prefix, const std::vector<Device>& devs,
                   const char* none) {
  out << title << ":\n";
  if (devs.empty()) out << "  " << none << "\n";
  for (size_t i = 0; i < devs.size(); ++i) {
    const Device& d = devs[i];
    out << "  " << prefix << i << "  " << join(d.names, ", ") << "  (" << join(d.kinds, ", ") << ")";
    out << "  " << (d.pci_bus_id.empty() ? "not on PCI" : "PCI " + d.pci_bus_id);
    out << "  NUMA node " << numa_list(d.locality);
    if (!d.locality.cpuset.empty()) out << "  CPUs " << d.locality.cpuset;
    if (!d.address.empty()) out << "  address " << d.address;
    out << "\n";
  }
}

void print_matrix(std::ostringstream& out, const Matrix& m) {
  size_t w = 6;
  for (const auto& l : m.labels) w = std::max(w, l.size() + 2);
  auto cell = [&](const std::string& s) { out << s << std::string(w > s.size() ? w - s.size() : 1, ' '); };
  cell("");
  for (const auto& l : m.labels) cell(l);
  out << "CPU affinity  NUMA affinity\n";
  for (size_t r = 0; r < m.labels.size(); ++r) {
    cell(m.labels[r]);
    for (size_t c = 0; c < m.labels.size(); ++c) cell(relation_symbol(m.cells[r][c]));
    std::string cpus = m.localities[r].cpuset.empty() ? "unknown" : m.localities[r].cpuset;
    out << cpus << std::string(cpus.size() < 14 ? 14 - cpus.size() : 1, ' ') << numa_list(m.localities[r]) << "\n";
  }
  out << "\nLegend:\n";
  for (Relation rel : {Relation::Self, Relation::SameNuma, Relation::SamePackage, Relation::CrossPackage,
                       Relation::Unknown}) {
    std::string sym = relation_symbol(rel);
    out << "  " << sym << std::string(6 - sym.size(), ' ') << "= " << relation_meaning(rel) << "\n";
  }
  out << "  NUMAn is NUMA node n as numactl numbers it (OS index); NICn and GPUn are the lists above.\n";
}

}  // namespace

std::string render_cpu_layout(const CpuLayout& l) {
  std::ostringstream out;
  out << "CPU layout (what `cohort run --bind` hands out, by OS CPU number):\n  cores:";
  for (size_t i = 0; i < l.cores.size(); ++i) out << (i ? " | " : " ") << core::cpu_list_text(l.cores[i]);
  out << "\n  NUMA nodes:";
  for (size_t i = 0; i < l.numa.size(); ++i)
    out << (i ? ", " : " ") << "node" << l.numa_ids[i] << ": " << core::cpu_list_text(l.numa[i]);
  out << "\n";
  return out.str();
}

std::string render_text(const Topology& t) {
  std::ostringstream out;
  out << "Host " << (t.hostname.empty() ? "(unknown)" : t.hostname);
  if (!t.architecture.empty()) out << ", " << t.architecture;
  if (!t.cpu_model.empty()) out << ", " << t.cpu_model;
  out << " (hwloc API " << t.hwloc_api_version << ")\n";
  if (!t.this_system)
    out << "NOTE: hwloc loaded this topology from HWLOC_XMLFILE / HWLOC_SYNTHETIC, not from this host\n";
  out << "L#n = hwloc's logical index, P#n = the OS's index (taskset, numactl)\n\n";
  print_tree(out, t.root, 0);

  out << "\nSummary: " << plural(t.packages, "package", "packages") << ", "
      << plural(t.numa_nodes_count, "NUMA node", "NUMA nodes") << ", " << plural(t.cores, "core", "cores") << ", "
      << plural(t.pus, "PU", "PUs") << " (hardware threads)";
  if (t.cores > 0 && t.pus > t.cores) out << ", " << t.pus / t.cores << " threads per core";
  out << "\nCaches:";
  if (t.caches.empty()) out << " none reported";
  for (const auto& [name, count] : t.caches) out << " " << name << " x" << count;
  out << "\n" << render_cpu_layout(t.cpus) << "\n";

  print_devices(out, "NICs", "NIC", t.nics,
                "none found (hwloc lists NICs on a PCI device; virtual interfaces such as lo or veth are not shown)");
  print_devices(out, "GPUs", "GPU", t.gpus, "none found");

  out << "\nMatrix (how far apart the NUMA nodes, NICs and GPUs are):\n\n";
  print_matrix(out, relation_matrix(t));
  return out.str();
}

}  // namespace cohort::topo
