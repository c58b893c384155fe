// Options of one `cohort run` job and the pure functions that check and resolve
// them. tools/cmd_run.cpp fills LaunchOptions from torchrun-style flags; the
// agent (agent.hpp) only ever sees a validated LaunchOptions. Everything here is
// a pure function of its arguments (plus the CPU count and PATH lookups named
// below), so tests call it directly.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace cohort::launch {

// torchrun's Std values: which of a worker's streams a flag applies to.
enum StdMask : int { kStdNone = 0, kStdOut = 1, kStdErr = 2, kStdBoth = 3 };

// The value of --tee / --redirects: "3" applies to every local rank, "0:3,1:2"
// to the listed local ranks only (the others get 0), as torchrun reads it.
struct StdSpec {
  int all = kStdNone;
  std::map<int, int> per_rank;
  int for_rank(int local_rank) const;
  bool any() const;
};

// Parses a --tee / --redirects value; `flag` names the flag in the error.
// Throws InvalidArgument on anything but 0..3 or LOCAL_RANK:0..3 lists.
StdSpec parse_std_spec(const std::string& text, const std::string& flag);

// --nproc-per-node: a positive integer, or "auto" / "cpu" = usable CPUs of this
// process (sched_getaffinity, so a cpuset-limited container counts its own).
int parse_nproc(const std::string& text);
int cpu_count();

// --nnodes: "N" (= N:N) or "MIN:MAX" with 1 <= MIN <= MAX. MIN < MAX
// (elastic membership) needs --rdzv-backend c10d; validate() checks that.
struct NodeRange {
  int min = 1;
  int max = 1;
};
NodeRange parse_nnodes(const std::string& text);

struct HostPort {
  std::string host;
  int port = 0;
};
// "host:port", "[v6addr]:port" or "host" (then default_port).
HostPort parse_endpoint(const std::string& text, int default_port);

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;      // --nnodes N, or MAX of MIN:MAX
  int min_nnodes = 0;  // MIN of --nnodes MIN:MAX; 0: = nnodes
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  bool master_addr_given = false;  // --master-addr was on the command line
  int master_port = 29500;
  bool master_port_given = false;
  bool standalone = false;         // one node, free ports for the program and the store
  std::string rdzv_endpoint;       // HOST[:PORT]; empty: derived from --master-addr/--master-port
  std::string rdzv_backend = "static";
  std::string run_id = "none";     // TORCHELASTIC_RUN_ID (torchrun's --rdzv-id)
  std::string role = "default";    // ROLE_NAME
  int max_restarts = 0;
  std::string log_dir;             // empty: no per-rank log files unless --tee/--redirects ask
  StdSpec tee;
  StdSpec redirects;
  bool no_python = false;
  bool module = false;             // -m: PROGRAM is a python module
  std::vector<std::string> command;  // PROGRAM ARGS..., passed through untouched
  std::string bind = "auto";       // --bind auto|none|numa|core (launch/binding.hpp)
  bool preflight = false;          // --preflight: run `cohort doctor` as the workers first (launch/doctor.hpp)
  double min_busbw = 0;            // --min-busbw GB/s for the pre-flight check (0: any)
};

// Checks ranges and combinations; throws InvalidArgument naming the flag and the fix.
void validate(const LaunchOptions& opts);

// The dynamic rendezvous (elastic_agent.hpp) runs the job: --rdzv-backend c10d
// with more than one node (or MIN < MAX). Otherwise the static one (agent.hpp).
bool is_elastic(const LaunchOptions& opts);
int min_nodes(const LaunchOptions& opts);

// Where the program's own store (MASTER_ADDR:MASTER_PORT) and the launcher's
// store (COHORT_STORE_ADDR:COHORT_STORE_PORT) live. They never share a port: a
// PyTorch program calling init_process_group("gloo") via env:// opens its own
// store on MASTER_PORT.
//   store:  --rdzv-endpoint HOST:PORT if given, else MASTER_ADDR:(MASTER_PORT+1).
//   master: --master-addr (default: the endpoint's host, else 127.0.0.1) and
//           --master-port (default 29500; moved to the store port + 1 when that
//           default would collide with the endpoint's port; an explicit clash
//           is an error).
// On one node the store binds 127.0.0.1 and workers reach it there; with several
// nodes node 0 binds every interface and workers use the endpoint's host.
// --standalone leaves both ports 0: the agent picks free ones.
struct Endpoints {
  std::string master_addr;
  int master_port = 0;
  std::string store_bind;  // address node 0's TcpStoreServer binds
  std::string store_addr;  // address launchers and workers connect to
  int store_port = 0;
};
Endpoints resolve_endpoints(const LaunchOptions& opts);

// The argv a worker runs (before PATH lookup): PROGRAM ARGS..., or
// "$PYTHON_EXEC -u PROGRAM.py ARGS..." / "$PYTHON_EXEC -u -m MODULE ARGS..."
// as torchrun does (PYTHON_EXEC defaults to python3), unless --no-python.
std::vector<std::string> worker_argv(const LaunchOptions& opts, const std::string& python_exec);

// The executable for argv[0]: as given when it contains '/', else the first
// executable match in `path_env` (a PATH value). Throws InvalidArgument saying
// what was searched when there is none.
std::string resolve_program(const std::string& name, const std::string& path_env);

}  // namespace cohort::launch
