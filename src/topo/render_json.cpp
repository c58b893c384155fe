// `cohort topo --json`: the same facts as the text view, for scripts and
// tests. The schema is documented in docs/observability.md; add fields, do
// not rename them (scripts read them).
#include <nlohmann/json.hpp>

#include "topo/topology.hpp"

namespace cohort::topo {
namespace {

using nlohmann::json;

json locality_json(const Locality& l) {
  return {{"cpuset", l.cpuset}, {"numa_nodes", l.numa_nodes}, {"packages", l.packages}};
}

json devices_json(const std::vector<Device>& devs, const char* prefix) {
  json a = json::array();
  for (size_t i = 0; i < devs.size(); ++i) {
    const Device& d = devs[i];
    a.push_back({{"label", prefix + std::to_string(i)},
                 {"names", d.names},
                 {"kinds", d.kinds},
                 {"pci_bus_id", d.pci_bus_id},
                 {"address", d.address},
                 {"locality", locality_json(d.locality)}});
  }
  return a;
}

json tree_json(const TreeNode& n) {
  json j = {{"type", n.type}, {"logical_index", n.logical}};
  if (n.os >= 0) j["os_index"] = n.os;
  if (n.bytes > 0) j["bytes"] = n.bytes;
  if (!n.children.empty()) {
    json c = json::array();
    for (const auto& child : n.children) c.push_back(tree_json(child));
    j["children"] = std::move(c);
  }
  return j;
}

// The lists `cohort run --bind` plans with, in the kernel's list syntax.
json cpu_layout_json(const CpuLayout& l) {
  json cores = json::array(), numa = json::array();
  for (const auto& c : l.cores) cores.push_back(core::cpu_list_text(c));
  for (size_t i = 0; i < l.numa.size(); ++i)
    numa.push_back({{"os_index", l.numa_ids[i]}, {"cpus", core::cpu_list_text(l.numa[i])}});
  return {{"online", core::cpu_list_text(l.online)}, {"cores", cores}, {"numa_nodes", numa}};
}

}  // namespace

std::string render_json(const Topology& t, int indent) {
  json caches = json::object();
  for (const auto& [name, count] : t.caches) caches[name] = count;

  json numa = json::array();
  for (const auto& n : t.numa_nodes)
    numa.push_back({{"logical_index", n.logical},
                    {"os_index", n.os},
                    {"cpuset", n.locality.cpuset},
                    {"memory_bytes", n.memory_bytes},
                    {"packages", n.locality.packages}});

  Matrix m = relation_matrix(t);
  json rows = json::array();
  for (const auto& row : m.cells) {
    json r = json::array();
    for (Relation rel : row) r.push_back(relation_symbol(rel));
    rows.push_back(std::move(r));
  }
  json legend = json::object();
  for (Relation rel : {Relation::Self, Relation::SameNuma, Relation::SamePackage, Relation::CrossPackage,
                       Relation::Unknown})
    legend[relation_symbol(rel)] = relation_meaning(rel);

  json j = {
      {"host", {{"hostname", t.hostname}, {"architecture", t.architecture}, {"cpu_model", t.cpu_model},
                {"memory_bytes", t.root.bytes}, {"this_system", t.this_system}}},
      {"hwloc_api_version", t.hwloc_api_version},
      {"counts",
       {{"packages", t.packages}, {"numa_nodes", t.numa_nodes_count}, {"cores", t.cores}, {"pus", t.pus},
        {"caches", caches}, {"nics", t.nics.size()}, {"gpus", t.gpus.size()}}},
      {"numa_nodes", numa},
      {"cpu_layout", cpu_layout_json(t.cpus)},
      {"nics", devices_json(t.nics, "NIC")},
      {"gpus", devices_json(t.gpus, "GPU")},
      {"matrix", {{"labels", m.labels}, {"rows", rows}, {"legend", legend}}},
      {"tree", tree_json(t.root)},
  };
  return j.dump(indent);
}

}  // namespace cohort::topo
