#include "launch/agent.hpp"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <optional>

#include <fmt/format.h>

#include "cohort/error.hpp"
#include "cohort/store.hpp"
#include "core/env.hpp"
#include "core/log.hpp"
#include "launch/binding.hpp"
#include "launch/elastic_agent.hpp"
#include "launch/monitor.hpp"
#include "launch/rendezvous.hpp"
#include "launch/run_id.hpp"
#include "launch/hang_report.hpp"
#include "launch/job.hpp"
#include "launch/job_secret_setup.hpp"
#include "launch/store_link.hpp"
#include "launch/worker_env.hpp"

extern char** environ;

namespace cohort::launch {
namespace {

const core::Knob kTermTimeout{"COHORT_TERM_TIMEOUT", "10s",
                              "cohort run: grace period between SIGTERM and SIGKILL when stopping workers",
                              core::KnobKind::Seconds};
const core::Knob kRdzvTimeout{"COHORT_RDZV_TIMEOUT", "600s",
                              "cohort run: how long a launcher waits for the store and for all --nnodes nodes to join",
                              core::KnobKind::Seconds};
const core::Knob kRdzvFinishTimeout{
    "COHORT_RDZV_FINISH_TIMEOUT", "300s",
    "cohort run: after this node's workers succeeded, how long its launcher waits for the other nodes' workers",
    core::KnobKind::Seconds};

std::chrono::milliseconds knob_ms(const core::Knob& k) {
  return k.millis();
}

void say(const std::string& line) { launcher_say("cohort run: " + line); }

// Everything fixed for the job before its first attempt.
struct Job {
  const LaunchOptions& opts;
  Endpoints ep;
  std::string run_id;         // TORCHELASTIC_RUN_ID
  std::string cohort_run_id;  // COHORT_RUN_ID
  JobSetup setup;             // program, log directory, host, CPU binding: as the elastic agent's (job.hpp)
};

// The workers of one attempt; exe / argv: the program's, or `cohort doctor` for --preflight.
std::vector<WorkerPlan> plan_attempt(const Job& job, int attempt, const std::string& exe,
                                     const std::vector<std::string>& argv) {
  JobEnv env;
  env.nproc_per_node = job.opts.nproc_per_node;
  env.nnodes = job.opts.nnodes;
  env.node_rank = job.opts.node_rank;
  env.role = job.opts.role;
  env.master_addr = job.ep.master_addr;
  env.master_port = job.ep.master_port;
  env.store_addr = job.ep.store_addr;
  env.store_port = job.ep.store_port;
  env.restart_count = attempt;
  env.max_restarts = job.opts.max_restarts;
  env.run_id = job.run_id;
  env.cohort_run_id = job.cohort_run_id;
  env.set_omp_threads = job.setup.set_omp;
  env.glibc_tunables = job.setup.glibc_tunables;
  env.host_cpus = job.setup.host_cpus;
  std::vector<WorkerPlan> plans;
  for (int lr = 0; lr < job.opts.nproc_per_node; ++lr) {
    WorkerPlan p;
    p.local_rank = lr;
    p.global_rank = job.opts.node_rank * job.opts.nproc_per_node + lr;
    p.spawn.path = exe;
    p.spawn.argv = argv;
    if (!job.setup.bind.cpus.empty()) p.spawn.cpus = job.setup.bind.cpus[static_cast<size_t>(lr)];
    p.spawn.env = merge_environment(environ, worker_env_vars(env, lr));
    p.route = route_streams(job.opts, lr);
    if (!job.setup.log_root.empty()) p.log_dir = worker_log_dir(job.setup.log_root, job.cohort_run_id, attempt, p.global_rank);
    plans.push_back(std::move(p));
  }
  return plans;
}

// "rank 1 (local 1, pid 4242) exited with code 3", plus the node with several.
std::string describe_failure(const Job& job, const WorkerExit& e) {
  std::string where = job.opts.nnodes > 1 ? fmt::format(" on node {} ({})", job.opts.node_rank, job.setup.host) : "";
  return fmt::format("rank {} (local {}, pid {}){} {}", e.global_rank, e.local_rank, e.pid, where, describe_exit(e));
}

Job prepare(const LaunchOptions& opts) {
  Job job{opts, resolve_endpoints(opts)};
  job.run_id = opts.standalone && opts.run_id == "none" ? random_hex(32) : opts.run_id;
  job.cohort_run_id = make_cohort_run_id(job.run_id);
  job.setup = prepare_job(opts);
  return job;
}

class Agent {
 public:
  explicit Agent(const LaunchOptions& opts) : opts_(opts), job_(prepare(opts)) {}

  SignalChannel& signals() { return signals_; }

  int run() {
    if (std::string w = ensure_job_secret(opts_.nnodes); !w.empty()) say(w);  // before the store: it reads the secret
    try {
      start_stores();
    } catch (const Interrupted& e) {
      say(fmt::format("received {} while waiting for the store; stopping", signal_name(e.signal())));
      return 128 + e.signal();
    }
    if (job_.setup.set_omp) launcher_say(omp_threads_notice(opts_.nproc_per_node));
    COHORT_INFO(kLaunch, "{}", describe_binding(job_.setup.bind_mode, job_.setup.bind));
    if (job_.setup.bind.oversubscribed)
      COHORT_WARN(kLaunch, "--bind core with {} local ranks on {} usable core(s): ranks share cores; --bind none lets "
                           "the scheduler balance them",
                  opts_.nproc_per_node, job_.setup.bind.usable_cores);
    int code = 1;
    try {
      code = attempts();
    } catch (const Interrupted& e) {
      say(fmt::format("received {} while waiting for the other nodes; stopping", signal_name(e.signal())));
      publish_final(fmt::format("the launcher of node {} ({}) was stopped by {}", opts_.node_rank, job_.setup.host,
                                signal_name(e.signal())));
      code = 128 + e.signal();
    } catch (const std::exception& e) {
      if (joined_) publish_final(fmt::format("the launcher of node {} ({}) failed: {}", opts_.node_rank, job_.setup.host,
                                             e.what()));
      finish_up();
      throw;
    }
    finish_up();
    return code;
  }

 private:
  void start_stores() {
    const bool multi = opts_.nnodes > 1;
    if (opts_.node_rank == 0) {
      server_ = host_store(job_.ep.store_bind, job_.ep.store_port);
      job_.ep.store_port = server_->port();
    }
    if (opts_.standalone) job_.ep.master_port = pick_free_port(job_.ep.master_addr);
    if (!multi) return;
    std::string addr = opts_.node_rank == 0 ? "127.0.0.1" : job_.ep.store_addr;
    store_ = connect_store(addr, job_.ep.store_port, knob_ms(kRdzvTimeout), signals_);
    RendezvousOptions r;
    r.run_id = job_.run_id;
    r.nnodes = opts_.nnodes;
    r.node_rank = opts_.node_rank;
    r.nproc_per_node = opts_.nproc_per_node;
    r.max_restarts = opts_.max_restarts;
    r.host = job_.setup.host;
    r.join_timeout = knob_ms(kRdzvTimeout);
    r.finish_timeout = knob_ms(kRdzvFinishTimeout);
    r.leave_timeout = knob_ms(kTermTimeout) + std::chrono::seconds(30);
    rdzv_ = std::make_unique<StaticRendezvous>(*store_, r, signals_);
  }

  int attempts() {
    for (int attempt = 0;; ++attempt) {
      attempt_ = attempt;
      if (rdzv_) {
        joined_ = false;
        rdzv_->join(attempt, job_.cohort_run_id);
        joined_ = true;
      }
      // After the join: a node other than 0 takes node 0's run id there.
      if (attempt == 0 && !job_.setup.log_root.empty())
        say(fmt::format("worker logs go to {}/{}", job_.setup.log_root, job_.cohort_run_id));
      if (attempt == 0 && opts_.preflight)
        if (int code = preflight(attempt); code >= 0) return code;
      std::vector<WorkerPlan> plans = plan_attempt(job_, attempt, job_.setup.exe, job_.setup.argv);
      bool no_restart = false;  // the store is gone, or a launcher left the job
      MonitorOptions mo = monitor_options(attempt, no_restart);
      AttemptResult r = run_attempt(plans, mo);
      remove_shm_segments(job_.cohort_run_id);
      if (r.unkillable) say("some workers survived SIGKILL; giving up on them (they may be stuck in the kernel)");
      if (r.outcome == AttemptResult::Outcome::WorkerFailed || r.outcome == AttemptResult::Outcome::RemoteFailed)
        if (auto v = fetch_hang_verdict(store_, job_.ep.store_port, attempt)) say(*v);  // once for the job

      if (r.outcome == AttemptResult::Outcome::Interrupted) {
        say(fmt::format("received {}; stopped {} worker(s)", signal_name(r.signal), r.stopped));
        publish_final(fmt::format("the launcher of node {} ({}) was stopped by {}", opts_.node_rank, job_.setup.host,
                                  signal_name(r.signal)));
        return 128 + r.signal;
      }
      std::string what;
      std::string stopped;
      if (r.outcome == AttemptResult::Outcome::Succeeded) {
        if (!rdzv_) return 0;
        std::optional<RemoteFailure> remote = rdzv_->finish(attempt);
        if (!remote) return 0;
        what = remote->what;
        no_restart = remote->final;
        stopped = "the workers of this node had already finished";
      } else if (r.outcome == AttemptResult::Outcome::WorkerFailed) {
        what = describe_failure(job_, *r.failure);
        stopped = fmt::format("stopped the other {} worker(s){}", r.stopped, rdzv_ ? " on this node" : "");
        if (!r.failure->stderr_log.empty()) stopped += fmt::format("; its stderr is in {}", r.failure->stderr_log);
      } else {
        what = r.remote_failure;
        stopped = fmt::format("stopped the {} worker(s) on this node (node {})", r.stopped, opts_.node_rank);
      }
      if (attempt < opts_.max_restarts && !no_restart) {
        say(fmt::format("{}; {}; restarting the workers (restart {} of {})", what, stopped, attempt + 1,
                        opts_.max_restarts));
        continue;
      }
      std::string restarts = opts_.max_restarts > 0 && attempt >= opts_.max_restarts
                                 ? fmt::format("; no restarts left (--max-restarts {})", opts_.max_restarts)
                                 : "";
      say(fmt::format("{}; {}{}", what, stopped, restarts));
      return 1;
    }
  }

  // How the monitor watches the other nodes during attempt k (multi-node only).
  MonitorOptions monitor_options(int attempt, bool& no_restart) {
    MonitorOptions mo;
    mo.signals = &signals_;
    mo.term_timeout = knob_ms(kTermTimeout);
    if (rdzv_) {
      mo.check_remote = [this, attempt, &no_restart]() -> std::optional<std::string> {
        try {
          std::optional<RemoteFailure> f = rdzv_->failure(attempt);
          if (!f) return std::nullopt;
          no_restart = no_restart || f->final;
          return f->what;
        } catch (const std::exception& e) {
          no_restart = true;
          return fmt::format("lost the launcher's store at {}:{} ({}); node 0's launcher has probably exited",
                             job_.ep.store_addr, job_.ep.store_port, e.what());
        }
      };
      mo.on_local_failure = [this, attempt](const WorkerExit& e) {
        try {
          rdzv_->publish_failure(attempt, {describe_failure(job_, e), false});
        } catch (const std::exception& ex) {
          COHORT_WARN(kLaunch, "could not tell the other nodes about the failure: {}", ex.what());
        }
      };
    }
    return mo;
  }

  // --preflight: `cohort doctor` as the workers, before the program's first
  // attempt. Returns -1 when the job is healthy, else the exit code.
  int preflight(int attempt) {
    say("--preflight: checking the job with `cohort doctor` before starting the program");
    std::error_code ec;
    const std::string self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
    if (ec) throw IoError(fmt::format("--preflight: cannot find this cohort binary (/proc/self/exe): {}", ec.message()));
    std::vector<std::string> argv{self, "doctor"};
    if (opts_.min_busbw > 0) argv.insert(argv.end(), {"--min-busbw", fmt::format("{}", opts_.min_busbw)});
    std::vector<WorkerPlan> plans = plan_attempt(job_, attempt, self, argv);
    bool no_restart = false;
    AttemptResult r = run_attempt(plans, monitor_options(attempt, no_restart));
    remove_shm_segments(job_.cohort_run_id);
    if (r.outcome == AttemptResult::Outcome::Interrupted) {
      say(fmt::format("received {} during the pre-flight check; stopped {} worker(s)", signal_name(r.signal), r.stopped));
      publish_final(fmt::format("the launcher of node {} ({}) was stopped by {}", opts_.node_rank, job_.setup.host,
                                signal_name(r.signal)));
      return 128 + r.signal;
    }
    if (r.outcome == AttemptResult::Outcome::Succeeded) {
      say(fmt::format("pre-flight check passed; starting {}", opts_.command[0]));
      return -1;
    }
    say(fmt::format("pre-flight check failed (the doctor's verdict is {}); refusing to start {}",
                    opts_.node_rank == 0 ? "above" : "in node 0's output, from rank 0", opts_.command[0]));
    publish_final(fmt::format("the pre-flight check failed on node {} ({})", opts_.node_rank, job_.setup.host));
    return 1;
  }

  // A launcher that stops or fails takes its node out of the job: the other
  // nodes stop too, without restarting (they would wait for this node in vain).
  void publish_final(const std::string& what) {
    if (!rdzv_) return;
    try {
      rdzv_->publish_failure(attempt_, {what, true});
    } catch (const std::exception& e) {
      COHORT_WARN(kLaunch, "could not tell the other nodes that this one stopped: {}", e.what());
    }
  }

  void finish_up() {
    remove_shm_segments(job_.cohort_run_id);
    if (rdzv_) rdzv_->leave();
  }

  // The signal channel comes first: the store server's thread must inherit the blocked mask.
  SignalChannel signals_;
  const LaunchOptions& opts_;
  Job job_;
  std::unique_ptr<TcpStoreServer> server_;
  std::shared_ptr<Store> store_;
  std::unique_ptr<StaticRendezvous> rdzv_;
  int attempt_ = 0;
  bool joined_ = false;  // this node is part of attempt_ (so its failures concern the others)
};

}  // namespace

namespace {

void log_to_console(std::string line) { ConsoleWriter::of(STDERR_FILENO).write_or_drop(std::move(line)); }

// The launcher's log lines go through its console thread while a job runs.
// Should an exception end the job, what is queued is written out before the
// message of it (printed by the caller) follows.
class LogsToConsole {
 public:
  LogsToConsole() : exceptions_(std::uncaught_exceptions()) { core::set_log_writer(&log_to_console); }
  ~LogsToConsole() {
    core::set_log_writer(nullptr);
    // A job that returned has drained already (finish_console with its signal
    // channel): what its teardown logged gets a moment; an exception, all it takes.
    if (std::uncaught_exceptions() > exceptions_)
      finish_console();
    else
      finish_console(std::chrono::milliseconds(1000));
  }
  LogsToConsole(const LogsToConsole&) = delete;
  LogsToConsole& operator=(const LogsToConsole&) = delete;

 private:
  int exceptions_;
};

}  // namespace

int run_job(const LaunchOptions& opts) {
  validate(opts);
  LogsToConsole logs;
  if (is_elastic(opts)) return run_elastic_job(opts);
  Agent agent(opts);
  const int code = agent.run();
  return finish_console(agent.signals(), code);  // while the stop signals are still the agent's to read
}

}  // namespace cohort::launch
