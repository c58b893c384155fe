// The mpirun command line for a test box, for Open MPI's mpirun and for MPICH's
// Hydra mpiexec (whichever CMake found: docs/mpi.md says both build).
#pragma once

#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

namespace cohort::testing {

// "openmpi", "hydra" (MPICH) or "" (could not run it), from `exec --version`.
inline std::string mpirun_flavour(const std::string& exec) {
  std::string out;
  if (FILE* f = ::popen((exec + " --version 2>&1").c_str(), "r")) {
    char buf[256];
    while (std::fgets(buf, sizeof buf, f)) out += buf;
    ::pclose(f);
  }
  if (out.find("Open MPI") != std::string::npos || out.find("OpenRTE") != std::string::npos) return "openmpi";
  if (out.find("HYDRA") != std::string::npos) return "hydra";
  return "";
}

// Open MPI needs: root allowed (CI containers), more ranks than cores,
// shared memory + self only (no traffic outside this host), and no
// cross-memory-attach copies (containers often forbid process_vm_readv).
// Hydra allows root and oversubscription as it is and keeps one host's
// ranks on shared memory.
inline std::vector<std::string> mpirun_args(const std::string& exec, int np) {
  if (mpirun_flavour(exec) == "hydra") return {exec, "-n", std::to_string(np)};
  std::vector<std::string> a = {exec,  "--oversubscribe", "--mca", "btl", "self,vader", "--mca",
                                "btl_vader_single_copy_mechanism", "none", "-np", std::to_string(np)};
  if (::geteuid() == 0) a.insert(a.begin() + 1, "--allow-run-as-root");
  return a;
}

}  // namespace cohort::testing
