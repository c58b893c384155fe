// load_topology(): asks hwloc for this host's topology and copies what
// `cohort topo` shows into plain data (topology.hpp). The only file that
// includes hwloc.h, so hwloc stays out of every other header.
//
// I/O discovery is off by default in hwloc 2; we keep the "important" I/O
// objects (PCI devices that have OS devices, and those OS devices: network,
// openfabrics, GPU, co-processor) and drop bridges and the rest.
#include <hwloc.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cohort/error.hpp"
#include "topo/topology.hpp"

namespace cohort::topo {
namespace {

// Owns an hwloc topology; destroys it on every path out of load_topology().
struct TopologyHandle {
  hwloc_topology_t t = nullptr;
  TopologyHandle() = default;
  TopologyHandle(const TopologyHandle&) = delete;
  TopologyHandle& operator=(const TopologyHandle&) = delete;
  ~TopologyHandle() {
    if (t) hwloc_topology_destroy(t);
  }
};

[[noreturn]] void fail(const std::string& step, int err) {
  std::string why = err ? std::strerror(err) : "no reason given";
  // hwloc's own variables redirect discovery; when one is set it is the likely cause.
  std::string set_vars;
  for (const char* var : {"HWLOC_COMPONENTS", "HWLOC_XMLFILE", "HWLOC_SYNTHETIC", "HWLOC_FSROOT"})
    if (const char* v = std::getenv(var)) set_vars += std::string(set_vars.empty() ? "" : ", ") + var + "='" + v + "'";
  std::string hint = set_vars.empty()
                         ? "HINT: check that /sys and /proc are mounted and readable (containers may hide them)"
                         : "HINT: hwloc was told where to look by " + set_vars + "; unset them or fix their values";
  throw IoError("hwloc could not load the host topology (" + step + ": " + why + "); " + hint);
}

std::string list_string(hwloc_const_bitmap_t set) {
  if (!set || hwloc_bitmap_iszero(set)) return "";
  char* s = nullptr;
  if (hwloc_bitmap_list_asprintf(&s, set) < 0 || !s) return "";
  std::string out(s);
  std::free(s);
  return out;
}

int os_index(hwloc_obj_t o) { return o->os_index == HWLOC_UNKNOWN_INDEX ? -1 : static_cast<int>(o->os_index); }

std::string info(hwloc_obj_t o, const char* name) {
  const char* v = o ? hwloc_obj_get_info_by_name(o, name) : nullptr;
  return v ? v : "";
}

// The name the tree shows: hwloc's type name, caches spelled L1d / L2 / L1i.
std::string type_name(hwloc_obj_t o) {
  if (hwloc_obj_type_is_cache(o->type)) {
    // Appended, not "L" + to_string(): GCC 12 warns falsely (-Wrestrict) on the latter.
    std::string n(1, 'L');
    n += std::to_string(o->attr->cache.depth);
    if (o->attr->cache.type == HWLOC_OBJ_CACHE_DATA) n += "d";
    if (o->attr->cache.type == HWLOC_OBJ_CACHE_INSTRUCTION) n += "i";
    return n;
  }
  return hwloc_obj_type_string(o->type);
}

TreeNode copy_tree(hwloc_obj_t o);

// NUMA nodes may hang below memory-side caches (MemCache); the tree shows
// the nodes and skips the caches.
void add_numa_children(hwloc_obj_t o, TreeNode& n) {
  for (hwloc_obj_t c = o->memory_first_child; c; c = c->next_sibling) {
    if (c->type == HWLOC_OBJ_NUMANODE) n.children.push_back(copy_tree(c));
    else add_numa_children(c, n);
  }
}

TreeNode copy_tree(hwloc_obj_t o) {
  TreeNode n{.type = type_name(o), .logical = static_cast<int>(o->logical_index), .os = os_index(o)};
  if (o->type == HWLOC_OBJ_NUMANODE) n.bytes = o->attr->numanode.local_memory;
  else if (hwloc_obj_type_is_cache(o->type)) n.bytes = o->attr->cache.size;
  else if (o->type == HWLOC_OBJ_MACHINE) n.bytes = o->total_memory;
  if (hwloc_obj_type_is_cache(o->type) || o->type == HWLOC_OBJ_GROUP) n.os = -1;
  add_numa_children(o, n);
  for (hwloc_obj_t c = o->first_child; c; c = c->next_sibling) n.children.push_back(copy_tree(c));
  return n;
}

// The NUMA nodes and packages close to `cpuset` / `nodeset`. A device hung
// off the Machine of a two-socket host gets both nodes and both packages,
// which relate() reads as "may cross the link".
Locality locality_of(hwloc_topology_t t, hwloc_const_cpuset_t cpuset, hwloc_const_nodeset_t nodeset) {
  Locality l;
  if (!cpuset || hwloc_bitmap_iszero(cpuset)) return l;
  l.cpuset = list_string(cpuset);
  if (nodeset) {
    for (int i = hwloc_bitmap_first(nodeset); i >= 0; i = hwloc_bitmap_next(nodeset, i)) l.numa_nodes.push_back(i);
  }
  int npkg = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_PACKAGE);
  for (int i = 0; i < npkg; ++i) {
    hwloc_obj_t p = hwloc_get_obj_by_type(t, HWLOC_OBJ_PACKAGE, static_cast<unsigned>(i));
    if (p && p->cpuset && hwloc_bitmap_intersects(p->cpuset, cpuset)) l.packages.push_back(i);
  }
  return l;
}

const char* osdev_kind(hwloc_obj_osdev_type_t type) {
  switch (type) {
    case HWLOC_OBJ_OSDEV_NETWORK: return "network";
    case HWLOC_OBJ_OSDEV_OPENFABRICS: return "openfabrics";
    case HWLOC_OBJ_OSDEV_GPU: return "gpu";
    case HWLOC_OBJ_OSDEV_COPROC: return "coproc";
    default: return nullptr;  // block, dma: not shown
  }
}

// Groups the OS devices by their PCI parent: eth0 and mlx5_0 on one card are
// one NIC, cuda0 / nvml0 / card1 on one board are one GPU.
void collect_devices(hwloc_topology_t t, Topology& out) {
  struct Pending {
    hwloc_obj_t key;  // PCI device, or the OS device itself when not on PCI
    bool gpu;
    Device dev;
  };
  std::vector<Pending> found;
  for (hwloc_obj_t o = hwloc_get_next_osdev(t, nullptr); o; o = hwloc_get_next_osdev(t, o)) {
    const char* kind = osdev_kind(o->attr->osdev.type);
    if (!kind || !o->name) continue;
    bool gpu = o->attr->osdev.type == HWLOC_OBJ_OSDEV_GPU || o->attr->osdev.type == HWLOC_OBJ_OSDEV_COPROC;
    hwloc_obj_t pci = (o->parent && o->parent->type == HWLOC_OBJ_PCI_DEVICE) ? o->parent : nullptr;
    hwloc_obj_t key = pci ? pci : o;
    auto it = std::find_if(found.begin(), found.end(), [&](const Pending& p) { return p.key == key && p.gpu == gpu; });
    if (it == found.end()) {
      Pending p{key, gpu, {}};
      if (pci) {
        char bus[32];
        std::snprintf(bus, sizeof bus, "%04x:%02x:%02x.%01x", pci->attr->pcidev.domain, pci->attr->pcidev.bus,
                      pci->attr->pcidev.dev, pci->attr->pcidev.func);
        p.dev.pci_bus_id = bus;
      }
      hwloc_obj_t anc = hwloc_get_non_io_ancestor_obj(t, o);
      if (anc) p.dev.locality = locality_of(t, anc->cpuset, anc->nodeset);
      found.push_back(std::move(p));
      it = found.end() - 1;
    }
    it->dev.names.push_back(o->name);
    it->dev.kinds.push_back(kind);
    if (it->dev.address.empty()) it->dev.address = info(o, "Address");
  }
  for (auto& p : found) (p.gpu ? out.gpus : out.nics).push_back(std::move(p.dev));
}

// The bitmap's members, ascending.
core::CpuList members(hwloc_const_bitmap_t set) {
  core::CpuList out;
  if (!set) return out;
  for (int i = hwloc_bitmap_first(set); i >= 0; i = hwloc_bitmap_next(set, i)) out.push_back(i);
  return out;
}

// The layout `--bind` plans with. Cores are hwloc's Core objects; where it
// has none (some architectures), every PU counts as a core. NUMA nodes
// without CPUs (HBM, CXL memory) are left out: nothing can be pinned there.
CpuLayout read_cpus(hwloc_topology_t t) {
  CpuLayout l;
  l.online = members(hwloc_topology_get_topology_cpuset(t));
  const int nodes = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE);
  std::vector<std::pair<int, core::CpuList>> by_os;
  for (int i = 0; i < nodes; ++i) {
    hwloc_obj_t n = hwloc_get_obj_by_type(t, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(i));
    core::CpuList cpus = members(n->cpuset);
    if (!cpus.empty()) by_os.emplace_back(os_index(n), std::move(cpus));
  }
  std::sort(by_os.begin(), by_os.end());
  if (by_os.empty()) by_os.emplace_back(0, l.online);
  for (auto& [id, cpus] : by_os) {
    l.numa_ids.push_back(id);
    l.numa.push_back(std::move(cpus));
  }
  const int ncores = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_CORE);
  for (int i = 0; i < ncores; ++i) {
    core::CpuList pus = members(hwloc_get_obj_by_type(t, HWLOC_OBJ_CORE, static_cast<unsigned>(i))->cpuset);
    if (!pus.empty()) l.cores.push_back(std::move(pus));
  }
  if (l.cores.empty())
    for (int cpu : l.online) l.cores.push_back({cpu});
  std::sort(l.cores.begin(), l.cores.end());
  return l;
}

// Initialises and loads a topology into h; io: with the important I/O devices.
void load(TopologyHandle& h, bool io) {
  if (hwloc_topology_init(&h.t) != 0) fail("hwloc_topology_init", errno);
  if (io) hwloc_topology_set_io_types_filter(h.t, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  if (hwloc_topology_load(h.t) != 0) fail("hwloc_topology_load", errno);
}

}  // namespace

CpuLayout load_cpu_layout() {
  TopologyHandle h;
  load(h, false);
  return read_cpus(h.t);
}

Topology load_topology() {
  TopologyHandle h;
  load(h, true);

  Topology out;
  hwloc_obj_t root = hwloc_get_root_obj(h.t);
  out.hostname = info(root, "HostName");
  out.architecture = info(root, "Architecture");
  unsigned v = hwloc_get_api_version();
  out.hwloc_api_version = std::to_string(v >> 16) + "." + std::to_string((v >> 8) & 0xff) + "." + std::to_string(v & 0xff);
  out.this_system = hwloc_topology_is_thissystem(h.t) != 0;
  hwloc_obj_t pkg0 = hwloc_get_obj_by_type(h.t, HWLOC_OBJ_PACKAGE, 0);
  out.cpu_model = info(pkg0, "CPUModel");

  out.packages = hwloc_get_nbobjs_by_type(h.t, HWLOC_OBJ_PACKAGE);
  out.numa_nodes_count = hwloc_get_nbobjs_by_type(h.t, HWLOC_OBJ_NUMANODE);
  out.cores = hwloc_get_nbobjs_by_type(h.t, HWLOC_OBJ_CORE);
  out.pus = hwloc_get_nbobjs_by_type(h.t, HWLOC_OBJ_PU);
  // Caches: hwloc keeps data / unified caches by default and drops L1i.
  for (hwloc_obj_type_t type : {HWLOC_OBJ_L1CACHE, HWLOC_OBJ_L2CACHE, HWLOC_OBJ_L3CACHE, HWLOC_OBJ_L4CACHE,
                                HWLOC_OBJ_L5CACHE, HWLOC_OBJ_L1ICACHE, HWLOC_OBJ_L2ICACHE, HWLOC_OBJ_L3ICACHE}) {
    int n = hwloc_get_nbobjs_by_type(h.t, type);
    if (n <= 0) continue;
    out.caches[type_name(hwloc_get_obj_by_type(h.t, type, 0))] += n;
  }

  out.root = copy_tree(root);
  for (int i = 0; i < out.numa_nodes_count; ++i) {
    hwloc_obj_t n = hwloc_get_obj_by_type(h.t, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(i));
    NumaNode node{.logical = i, .os = os_index(n), .memory_bytes = n->attr->numanode.local_memory};
    // A CPU-less node (HBM, CXL memory) takes the CPUs of the object it hangs off.
    hwloc_const_cpuset_t cpus = n->cpuset;
    if ((!cpus || hwloc_bitmap_iszero(cpus)) && n->parent) cpus = n->parent->cpuset;
    node.locality = locality_of(h.t, cpus, n->nodeset);
    out.numa_nodes.push_back(std::move(node));
  }
  collect_devices(h.t, out);
  out.cpus = read_cpus(h.t);
  return out;
}

}  // namespace cohort::topo
