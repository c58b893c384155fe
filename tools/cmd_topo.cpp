// `cohort topo`: the host as hwloc sees it (packages, NUMA nodes, caches,
// cores, hardware threads, NICs, GPUs) and a matrix of how far apart the NUMA
// nodes and devices are, like `nvidia-smi topo -m`. docs/observability.md
// explains how to read it.
#include <cstdio>

#include "commands.hpp"
#include "topo/topology.hpp"

namespace cohort::tools {

void add_topo_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("topo", "show the host's topology (hwloc) and a NUMA / NIC / GPU relation matrix");
  static bool json = false;
  cmd->add_flag("--json", json, "print JSON (counts, NUMA nodes, NICs, GPUs, matrix, tree) instead of text");
  // load_topology() throws IoError when hwloc fails; main() prints it and exits 1.
  cmd->callback([&exit_code] {
    topo::Topology t = topo::load_topology();
    std::string out = json ? topo::render_json(t) : topo::render_text(t);
    std::fwrite(out.data(), 1, out.size(), stdout);
    if (json) std::fputc('\n', stdout);
    exit_code = 0;
  });
}

}  // namespace cohort::tools
