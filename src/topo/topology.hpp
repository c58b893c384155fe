// The host's topology as plain data: what `cohort topo` prints, and the CPU
// layout that `cohort run --bind` plans with (one reader for both: hwloc).
//
// hwloc stays behind load_topology() (src/topo/hwloc_probe.cpp): nothing here
// includes hwloc, so the renderers and the relation matrix are pure functions
// that tests can feed with made-up machines.
//
// Indexes: `logical` is hwloc's logical index (L#, dense, in topology order);
// `os` is the operating system's index (P#, what taskset, numactl and
// /sys/devices/system/node use). NUMA node sets below hold OS indexes.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/cpu_list.hpp"

namespace cohort::topo {

// The CPUs a worker can be pinned to, by OS index (what sched_setaffinity and
// taskset take). Both `cohort topo` and `cohort run --bind` read it through
// hwloc (load_cpu_layout, or Topology::cpus), so they show the same lists.
struct CpuLayout {
  core::CpuList online;              // every PU hwloc reports (online and allowed)
  std::vector<core::CpuList> numa;   // CPUs of each NUMA node that has any, by OS node number
  std::vector<int> numa_ids;         // the node numbers, parallel to `numa`
  std::vector<core::CpuList> cores;  // hardware threads of each physical core, by lowest CPU
};

// One object of hwloc's tree that `cohort topo` shows: Machine, Package, Die,
// Group, NUMANode, L1d..L5 caches, Core, PU. I/O objects are not in the tree;
// they are listed as Devices.
struct TreeNode {
  std::string type;  // hwloc's type name, caches as "L3", "L1d", "L1i"
  int logical = -1;
  int os = -1;             // -1 when the OS gives no index (caches, groups)
  std::uint64_t bytes = 0;  // NUMANode: local memory; cache: size; Machine: total memory
  std::vector<TreeNode> children;  // memory children (NUMA nodes) first, then the others
};

// Where something sits: the NUMA nodes and packages whose CPUs are closest to
// it. Both empty means "unknown" (hwloc could not place it).
struct Locality {
  std::string cpuset;              // list syntax, "0-3,8"; empty when unknown
  std::vector<int> numa_nodes;     // OS indexes, sorted
  std::vector<int> packages;       // logical indexes, sorted
};

struct NumaNode {
  int logical = -1;
  int os = -1;
  std::uint64_t memory_bytes = 0;  // local memory
  Locality locality;               // its own CPUs; numa_nodes is {os}
};

// A NIC or GPU: one PCI device (or one OS device when hwloc found no PCI
// parent) with the OS devices hwloc saw on it, e.g. {"eth0"} or
// {"ens1f0", "mlx5_0"} for an RDMA NIC.
struct Device {
  std::vector<std::string> names;  // OS device names: eth0, mlx5_0, cuda0, card0, ...
  std::vector<std::string> kinds;  // per name: "network", "openfabrics", "gpu", "coproc"
  std::string pci_bus_id;          // "0000:00:03.0", empty when not on PCI
  std::string address;             // MAC / GID address when hwloc reports one
  Locality locality;
};

struct Topology {
  std::string hostname, architecture, cpu_model;
  std::string hwloc_api_version;  // of the hwloc library loaded at run time, e.g. "2.8.0"
  // True when hwloc discovered this host; false when HWLOC_XMLFILE or
  // HWLOC_SYNTHETIC made it load something else (tests use that).
  bool this_system = true;
  int packages = 0, numa_nodes_count = 0, cores = 0, pus = 0;
  std::map<std::string, int> caches;  // "L1d" -> count, "L2" -> count, ...
  TreeNode root;                      // the Machine
  std::vector<NumaNode> numa_nodes;   // in logical order
  std::vector<Device> nics;
  std::vector<Device> gpus;
  CpuLayout cpus;  // the cores and NUMA nodes as --bind sees them
};

// Loads this host's topology with hwloc (I/O devices included).
// Throws IoError naming hwloc's reason and a fix when hwloc cannot load it.
Topology load_topology();

// Only the CPU layout (no I/O discovery: cheaper, for `cohort run --bind`);
// the same as load_topology().cpus. Throws like load_topology().
CpuLayout load_cpu_layout();

// Pure: "cores 0 | 1 | 2-3" style lines for `cohort topo` (render_text.cpp).
std::string render_cpu_layout(const CpuLayout& l);

// How far apart two endpoints (NUMA nodes, NICs, GPUs) are. The matrix uses
// the symbols in relation_symbol(); see docs/observability.md.
enum class Relation {
  Self,          // X
  SameNuma,      // NODE: one NUMA node, the same one
  SamePackage,   // PKG: different NUMA nodes (or a spread) inside one package
  CrossPackage,  // SYS: traffic crosses the link between packages
  Unknown,       // ?: one side has no known locality
};

const char* relation_symbol(Relation r);
const char* relation_meaning(Relation r);

// Pure: the relation between two localities (never Self; the caller knows
// when a row meets its own column).
Relation relate(const Locality& a, const Locality& b);

struct Matrix {
  std::vector<std::string> labels;  // "NUMA0" (OS index), "NIC0", "GPU0" (list order)
  std::vector<Locality> localities;  // one per label
  std::vector<std::vector<Relation>> cells;  // cells[row][col]
};

// Pure: the NUMA nodes, then the NICs, then the GPUs, each against each.
Matrix relation_matrix(const Topology& t);

// Renderers (render_text.cpp, render_json.cpp). Pure: they only read `t`.
std::string render_text(const Topology& t);
std::string render_json(const Topology& t, int indent = 2);

// "15.6 GiB", "512 KiB", "0 B": binary units, one decimal above KiB.
std::string human_bytes(std::uint64_t bytes);

}  // namespace cohort::topo
