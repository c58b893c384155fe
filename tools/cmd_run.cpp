// `cohort run`: the launcher, a drop-in for torchrun. Parses torchrun's flags
// (both spellings: --nproc-per-node and --nproc_per_node) into LaunchOptions
// and hands them to the agent (src/launch/agent.hpp). Everything from PROGRAM
// on is passed to the program untouched: the subcommand is a CLI11 prefix
// command, so options after PROGRAM are not parsed here.
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cohort/error.hpp"
#include "commands.hpp"
#include "core/env.hpp"
#include "launch/agent.hpp"
#include "launch/options.hpp"

namespace cohort::tools {
namespace {

// Raw flag values, kept alive by the callback (CLI11 writes into them while parsing).
struct RunFlags {
  std::string nproc = "1";
  std::string nnodes = "1";
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool standalone = false;
  std::string rdzv_endpoint;
  std::string rdzv_backend = "static";
  std::string run_id = "none";
  std::string role = "default";
  int max_restarts = 0;
  std::string log_dir;
  std::string tee = "0";
  std::string redirects = "0";
  bool no_python = false;
  bool module = false;
  // Accepted for torchrun compatibility; they change nothing (see docs/launcher.md).
  double monitor_interval = 0.1;
  std::string start_method = "spawn";
  std::string rdzv_conf;
  std::string bind = "auto";
  bool preflight = false;
  double min_busbw = 0;
};

const char* kFooter = R"(
PROGRAM ending in .py runs as `python3 -u PROGRAM` (and -m MODULE as `python3 -u -m MODULE`),
unless --no-python; PYTHON_EXEC overrides python3. Everything after PROGRAM goes to it untouched.

Examples:
  cohort run --nproc-per-node 4 train.py --epochs 3
  cohort run --standalone --nproc-per-node auto ./my_program --flag
  cohort run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --nproc-per-node 8 train.py   # on host 0
  cohort run --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --nproc-per-node 8 train.py   # on host 1
  cohort run --nnodes 2:4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29400 --rdzv-id job7 \
      --max-restarts 3 train.py                                                               # on every host

Environment of each worker: RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE
ROLE_RANK ROLE_WORLD_SIZE ROLE_NAME MASTER_ADDR MASTER_PORT TORCHELASTIC_RESTART_COUNT
TORCHELASTIC_MAX_RESTARTS TORCHELASTIC_RUN_ID TORCHELASTIC_USE_AGENT_STORE COHORT_STORE_ADDR
COHORT_STORE_PORT COHORT_RUN_ID (OMP_NUM_THREADS=1 when unset). See docs/launcher.md.
Exit code: 0 all workers succeeded, 1 a worker failed or the job could not start, 128+N stopped by signal N.)";

}  // namespace

void add_run_command(CLI::App& app, int& exit_code) {
  auto f = std::make_shared<RunFlags>();
  auto* cmd = app.add_subcommand("run", "launch workers like torchrun: cohort run [flags] PROGRAM [ARGS...]");
  cmd->footer(kFooter);
  cmd->prefix_command();  // stop at PROGRAM; it and its arguments land in remaining()

  // As torchrun, every torchrun flag can also come from PET_<FLAG> (Kubeflow's
  // PyTorchJob sets PET_NNODES, PET_NODE_RANK, ...); a flag on the command line wins.
  cmd->add_option("--nproc-per-node,--nproc_per_node", f->nproc,
                  "workers on this node: a number, or auto / cpu (one per CPU)")->capture_default_str()
      ->envname("PET_NPROC_PER_NODE");
  cmd->add_option("--nnodes", f->nnodes,
                  "number of nodes, N or MIN:MAX (MIN < MAX: elastic, needs --rdzv-backend c10d)")
      ->capture_default_str()
      ->envname("PET_NNODES");
  cmd->add_option("--node-rank,--node_rank", f->node_rank, "rank of this node, 0..nnodes-1")->capture_default_str()
      ->envname("PET_NODE_RANK");
  cmd->add_option("--master-addr,--master_addr", f->master_addr, "MASTER_ADDR for the program (node 0's address)")
      ->capture_default_str()
      ->envname("PET_MASTER_ADDR");
  cmd->add_option("--master-port,--master_port", f->master_port,
                  "MASTER_PORT for the program; the launcher's store uses MASTER_PORT+1")->capture_default_str()
      ->envname("PET_MASTER_PORT");
  cmd->add_flag("--standalone", f->standalone, "one node; pick free ports for the program and the launcher's store")
      ->envname("PET_STANDALONE");
  cmd->add_option("--rdzv-endpoint,--rdzv_endpoint", f->rdzv_endpoint,
                  "HOST:PORT of the launcher's store, hosted by node 0 (default MASTER_ADDR:MASTER_PORT+1)")
      ->envname("PET_RDZV_ENDPOINT");
  cmd->add_option("--rdzv-backend,--rdzv_backend", f->rdzv_backend,
                  "static (node 0 hosts the store, --node-rank given) or c10d (dynamic: ranks assigned, any start "
                  "order, MIN:MAX)")
      ->capture_default_str()
      ->envname("PET_RDZV_BACKEND");
  cmd->add_option("--rdzv-id,--rdzv_id,--run-id,--run_id", f->run_id, "job id, TORCHELASTIC_RUN_ID")
      ->capture_default_str()
      ->envname("PET_RDZV_ID");
  cmd->add_option("--role", f->role, "ROLE_NAME of the workers")->capture_default_str()
      ->envname("PET_ROLE");
  cmd->add_option("--max-restarts,--max_restarts", f->max_restarts,
                  "restart all workers up to this many times after a failure")->capture_default_str()
      ->envname("PET_MAX_RESTARTS");
  cmd->add_option("--log-dir,--log_dir", f->log_dir,
                  "write each worker's stdout/stderr to DIR/<run id>/attempt_<k>/<rank>/{stdout,stderr}.log")
      ->envname("PET_LOG_DIR");
  cmd->add_option("-t,--tee", f->tee, "also write these streams to log files: 0 none, 1 stdout, 2 stderr, 3 both; "
                                      "or per local rank, e.g. 0:3,1:2")->capture_default_str()
      ->envname("PET_TEE");
  cmd->add_option("-r,--redirects", f->redirects,
                  "send these streams to log files instead of the console (values as --tee)")->capture_default_str()
      ->envname("PET_REDIRECTS");
  cmd->add_flag("--no-python,--no_python", f->no_python, "run PROGRAM directly even when it ends in .py")
      ->envname("PET_NO_PYTHON");
  cmd->add_flag("-m,--module", f->module, "PROGRAM is a python module: run `python3 -u -m PROGRAM`")
      ->envname("PET_MODULE");
  cmd->add_option("--monitor-interval,--monitor_interval", f->monitor_interval, "accepted for torchrun; ignored")
      ->envname("PET_MONITOR_INTERVAL");
  cmd->add_option("--start-method,--start_method", f->start_method, "accepted for torchrun; ignored")
      ->envname("PET_START_METHOD");
  cmd->add_option("--rdzv-conf,--rdzv_conf", f->rdzv_conf, "accepted for torchrun; ignored")
      ->envname("PET_RDZV_CONF");
  cmd->add_option("--bind", f->bind, "pin each local rank: auto (core when 2 <= local ranks <= cores, else none), "
                                     "none, numa (the CPUs of one NUMA node) or core (its own cores)")
      ->capture_default_str();
  cmd->add_flag("--preflight", f->preflight, "run `cohort doctor` as the workers first; refuse to start PROGRAM "
                                             "when a link is broken or below --min-busbw");
  cmd->add_option("--min-busbw", f->min_busbw, "with --preflight: GB/s every link class must reach (0: any)")
      ->capture_default_str();

  cmd->callback([cmd, f, &exit_code] {
    // A bad COHORT_* value fails here, not when (or if) the code that reads it runs.
    if (const auto bad = core::knob_problems(); !bad.empty()) {
      std::string all;
      for (const auto& b : bad) all += (all.empty() ? "" : "; ") + b;
      throw InvalidArgument(fmt::format("cohort run: {} (`cohort env` lists every knob)", all));
    }
    launch::LaunchOptions o;
    o.nproc_per_node = launch::parse_nproc(f->nproc);
    launch::NodeRange nodes = launch::parse_nnodes(f->nnodes);
    o.nnodes = nodes.max;
    o.min_nnodes = nodes.min;
    o.node_rank = f->node_rank;
    o.master_addr = f->master_addr;
    o.master_addr_given = cmd->count("--master-addr") > 0;
    o.master_port = f->master_port;
    o.master_port_given = cmd->count("--master-port") > 0;
    o.standalone = f->standalone;
    o.rdzv_endpoint = f->rdzv_endpoint;
    o.rdzv_backend = f->rdzv_backend;
    // torchrun with a c10d rendezvous on one node picks free ports (its docs
    // suggest --rdzv-endpoint localhost:0 to run several such jobs on one
    // machine): that is --standalone here; the endpoint has no one to meet.
    const bool any_endpoint = o.rdzv_endpoint.empty() || o.rdzv_endpoint.ends_with(":0");
    if (o.rdzv_backend == "c10d" && o.nnodes == 1 && o.min_nnodes == 1 && !o.standalone && any_endpoint &&
        !o.master_port_given) {
      o.standalone = true;
      o.rdzv_endpoint.clear();
    }
    o.run_id = f->run_id;
    o.role = f->role;
    o.max_restarts = f->max_restarts;
    o.log_dir = f->log_dir;
    o.tee = launch::parse_std_spec(f->tee, "--tee");
    o.redirects = launch::parse_std_spec(f->redirects, "--redirects");
    o.no_python = f->no_python;
    o.module = f->module;
    o.command = cmd->remaining();
    o.bind = f->bind;
    o.preflight = f->preflight;
    o.min_busbw = f->min_busbw;
    exit_code = launch::run_job(o);
  });
}

}  // namespace cohort::tools
