#include "launch/elastic_agent.hpp"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>

#include "cohort/error.hpp"
#include "cohort/store.hpp"
#include "core/clock.hpp"
#include "core/cpu_list.hpp"
#include "core/env.hpp"
#include "core/fd.hpp"
#include "core/log.hpp"
#include "launch/elastic_rendezvous.hpp"
#include "launch/hang_report.hpp"
#include "launch/job_secret_setup.hpp"
#include "launch/job.hpp"
#include "launch/liveness.hpp"
#include "launch/monitor.hpp"
#include "launch/run_id.hpp"
#include "launch/store_link.hpp"

namespace cohort::launch {
namespace {

const core::Knob kLastCall{"COHORT_RDZV_LAST_CALL", "10s",
                           "cohort run --rdzv-backend c10d: once --nnodes MIN nodes have joined a round, how long to "
                           "wait for more (up to MAX) before the round closes",
                           core::KnobKind::Seconds};
const core::Knob kHeartbeatTimeout{
    "COHORT_HEARTBEAT_TIMEOUT", "15s",
    "cohort run --rdzv-backend c10d: a launcher whose heartbeat in the store stops for this long is lost (killed, "
    "host down, link cut); it also bounds each store call of a launcher",
    core::KnobKind::Seconds};

// The static agent's knobs (agent.cpp), looked up by name so each is declared once.
std::chrono::milliseconds knob_ms(const char* name) {
  for (const core::Knob* k : core::all_knobs())
    if (std::strcmp(k->name(), name) == 0)
      return k->millis();
  throw std::logic_error(fmt::format("knob {} is not registered", name));
}
std::chrono::milliseconds knob_ms(const core::Knob& k) {
  return k.millis();
}

void say(const std::string& line) { launcher_say("cohort run: " + line); }

enum class StoreRole { HostLoopback, HostAll, Client };

// Whether this host owns the endpoint's address: a bind to it (port 0) works
// only on the host that has it.
StoreRole store_role(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return StoreRole::Client;
  StoreRole role = StoreRole::Client;
  for (addrinfo* ai = res; ai != nullptr && role == StoreRole::Client; ai = ai->ai_next) {
    auto* in = reinterpret_cast<sockaddr_in*>(ai->ai_addr);
    if ((ntohl(in->sin_addr.s_addr) >> 24) == 127) {
      role = StoreRole::HostLoopback;
      break;
    }
    const core::Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd.valid()) continue;
    sockaddr_in a = *in;
    a.sin_port = 0;
    if (bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) role = StoreRole::HostAll;
  }
  freeaddrinfo(res);
  return role;
}

// The local address this host uses to reach `host` (a UDP connect sends nothing).
std::string local_address_towards(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || res == nullptr) return "127.0.0.1";
  std::string out = "127.0.0.1";
  const core::Fd fd(socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (fd.valid() && connect(fd.get(), res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_in me{};
    socklen_t len = sizeof(me);
    char buf[INET_ADDRSTRLEN] = {};
    if (getsockname(fd.get(), reinterpret_cast<sockaddr*>(&me), &len) == 0 &&
        inet_ntop(AF_INET, &me.sin_addr, buf, sizeof(buf)) != nullptr)
      out = buf;
  }
  freeaddrinfo(res);
  return out;
}

std::string describe_nodes(const Round& r) {
  std::vector<std::string> parts;
  for (const RoundNode& n : r.nodes) parts.push_back(fmt::format("{} {} ({} worker(s))", n.node_rank, n.host, n.nproc));
  return fmt::format("{}", fmt::join(parts, ", "));
}

class ElasticAgent {
 public:
  explicit ElasticAgent(const LaunchOptions& opts)
      : opts_(opts), job_(prepare_job(opts)), ep_(resolve_endpoints(opts)), tracker_(knob_ms(kHeartbeatTimeout)) {}

  SignalChannel& signals() { return signals_; }
  // A stop signal that cut the goodbye short (after the job's outcome was settled), or 0.
  int stopped_while_leaving() const { return stopped_while_leaving_; }

  int run() {
    if (std::string w = ensure_job_secret(opts_.nnodes); !w.empty()) say(w);  // before the store: it reads the secret
    try {
      connect();
    } catch (const Interrupted& e) {
      say(fmt::format("received {} while waiting for the store; stopping", signal_name(e.signal())));
      return 128 + e.signal();
    }
    if (job_.set_omp) launcher_say(omp_threads_notice(opts_.nproc_per_node));
    if (!job_.log_root.empty()) say(fmt::format("worker logs go to {}/{}", job_.log_root, cohort_run_id_));
    COHORT_INFO(kLaunch, "{}", describe_binding(job_.bind_mode, job_.bind));
    int code = 1;
    try {
      code = rounds();
    } catch (const Interrupted& e) {
      say(fmt::format("received {} while waiting for the other nodes; stopping", signal_name(e.signal())));
      publish_stop(fmt::format("the launcher on {} was stopped by {}", job_.host, signal_name(e.signal())));
      code = 128 + e.signal();
    } catch (const JobEnded& e) {
      say(e.what());
      code = 1;
    } catch (const std::exception& e) {
      publish_stop(fmt::format("the launcher on {} failed: {}", job_.host, e.what()));
      finish_up();
      throw;
    }
    finish_up();
    return code;
  }

 private:
  void connect() {
    const std::chrono::milliseconds hb_timeout = knob_ms(kHeartbeatTimeout);
    StoreRole role = store_role(ep_.store_addr);
    if (role != StoreRole::Client) {
      try {
        server_ = std::make_unique<TcpStoreServer>(role == StoreRole::HostLoopback ? "127.0.0.1" : "0.0.0.0",
                                                   static_cast<uint16_t>(ep_.store_port));
        COHORT_INFO(kLaunch, "hosting the rendezvous store on port {}", ep_.store_port);
      } catch (const Error& e) {
        // Another launcher on this host hosts it already: be its client.
        COHORT_INFO(kLaunch, "not hosting the store ({}); connecting to it", e.what());
      }
    }
    const std::string addr = server_ && role == StoreRole::HostLoopback ? "127.0.0.1" : ep_.store_addr;
    store_ = connect_store(addr, ep_.store_port, knob_ms("COHORT_RDZV_TIMEOUT"), signals_, hb_timeout);
    ElasticOptions eo;
    eo.run_id = opts_.run_id;
    eo.min_nodes = min_nodes(opts_);
    eo.max_nodes = opts_.nnodes;
    eo.nproc_per_node = opts_.nproc_per_node;
    eo.max_restarts = opts_.max_restarts;
    eo.host = job_.host;
    eo.last_call = knob_ms(kLastCall);
    eo.join_timeout = knob_ms("COHORT_RDZV_TIMEOUT");
    eo.finish_timeout = knob_ms("COHORT_RDZV_FINISH_TIMEOUT");
    rdzv_ = std::make_unique<ElasticRendezvous>(*store_, eo, signals_);
    agent_ = rdzv_->register_agent();
    auto interval = std::clamp(hb_timeout / 5, std::chrono::milliseconds(100), std::chrono::milliseconds(2000));
    auto hb_store = connect_store(addr, ep_.store_port, knob_ms("COHORT_RDZV_TIMEOUT"), signals_, hb_timeout);
    heartbeat_ = std::make_unique<Heartbeat>(hb_store, heartbeat_key(rdzv_->prefix(), agent_), interval);
    cohort_run_id_ = rdzv_->agree_run_id(make_cohort_run_id(opts_.run_id));
    say(fmt::format("joined job {} at {}:{} as launcher {}{}; waiting for --nnodes {}:{} nodes", opts_.run_id,
                    ep_.store_addr, ep_.store_port, agent_, server_ ? " (hosting the store)" : "", min_nodes(opts_),
                    opts_.nnodes));
  }

  std::pair<std::string, int> pick_master() {
    std::string addr = opts_.master_addr_given ? opts_.master_addr : local_address_towards(ep_.store_addr);
    return {addr, pick_free_port(addr)};
  }

  int rounds() {
    int next = 0;
    for (;;) {
      Round r = rdzv_->join(agent_, next, [this] { return pick_master(); });
      round_ = r.round;
      const RoundNode& me = r.me();
      say(fmt::format("round {}: this is node {} of {} ({}), ranks {}..{} of {}; nodes: {}", r.round, r.node_rank,
                      r.nodes.size(), job_.host, me.rank_base, me.rank_base + me.nproc - 1, r.world_size,
                      describe_nodes(r)));
      tracker_ = LivenessTracker(knob_ms(kHeartbeatTimeout));
      JobEnv env;
      env.nproc_per_node = opts_.nproc_per_node;
      env.nnodes = static_cast<int>(r.nodes.size());
      env.node_rank = r.node_rank;
      env.rank_base = me.rank_base;
      env.world_size = r.world_size;
      env.role = opts_.role;
      env.master_addr = r.master_addr;
      env.master_port = r.master_port;
      env.store_addr = ep_.store_addr;
      env.store_port = ep_.store_port;
      env.restart_count = r.round;
      env.max_restarts = opts_.max_restarts;
      env.run_id = opts_.run_id;
      env.cohort_run_id = cohort_run_id_;
      env.set_omp_threads = job_.set_omp;
      env.glibc_tunables = job_.glibc_tunables;
      env.host_cpus = job_.host_cpus;
      std::vector<WorkerPlan> plans = plan_workers(opts_, job_, env);

      bool no_restart = false;
      MonitorOptions mo;
      mo.signals = &signals_;
      mo.term_timeout = knob_ms("COHORT_TERM_TIMEOUT");
      mo.check_remote = [this, &r, &no_restart] { return check_remote(r, no_restart); };
      mo.on_local_failure = [this, &r](const WorkerExit& e) {
        try {
          rdzv_->publish_failure(r.round, {describe(r, e), false});
        } catch (const std::exception& ex) {
          COHORT_WARN(kLaunch, "could not tell the other nodes about the failure: {}", ex.what());
        }
      };
      AttemptResult res = run_attempt(plans, mo);
      remove_shm_segments(cohort_run_id_);
      if (res.unkillable) say("some workers survived SIGKILL; giving up on them (they may be stuck in the kernel)");
      if (res.outcome == AttemptResult::Outcome::WorkerFailed || res.outcome == AttemptResult::Outcome::RemoteFailed)
        if (auto v = fetch_hang_verdict(store_, ep_.store_port, r.round)) say(*v);  // once per node

      if (res.outcome == AttemptResult::Outcome::Interrupted) {
        say(fmt::format("received {}; stopped {} worker(s)", signal_name(res.signal), res.stopped));
        publish_stop(fmt::format("the launcher of node {} ({}) was stopped by {}", r.node_rank, job_.host,
                                 signal_name(res.signal)));
        return 128 + res.signal;
      }
      std::string what, stopped;
      if (res.outcome == AttemptResult::Outcome::Succeeded) {
        std::optional<RemoteFailure> f;
        try {
          f = rdzv_->finish(r, [this, &r]() -> std::optional<RemoteFailure> {
            if (auto e = rdzv_->end()) return RemoteFailure{"the job was stopped: " + e->substr(2), true};
            return check_liveness(r);
          });
        } catch (const TimeoutError&) {
          throw;
        } catch (const Interrupted&) {
          throw;
        } catch (const std::exception& e) {
          store_lost_ = true;
          f = RemoteFailure{lost_store_message(e.what()), true};
        }
        if (!f) {
          rdzv_->publish_end("ok");
          return 0;
        }
        what = f->what;
        no_restart = f->final;
        stopped = "the workers of this node had already finished";
      } else if (res.outcome == AttemptResult::Outcome::WorkerFailed) {
        what = describe(r, *res.failure);
        stopped = fmt::format("stopped the other {} worker(s) on this node", res.stopped);
        if (!res.failure->stderr_log.empty()) stopped += fmt::format("; its stderr is in {}", res.failure->stderr_log);
      } else {
        what = res.remote_failure;
        stopped = fmt::format("stopped the {} worker(s) on this node (node {})", res.stopped, r.node_rank);
      }
      if (r.round < opts_.max_restarts && !no_restart && !store_lost_) {
        say(fmt::format("{}; {}; restarting the workers (restart {} of {})", what, stopped, r.round + 1,
                        opts_.max_restarts));
        next = r.round + 1;
        continue;
      }
      std::string restarts = opts_.max_restarts > 0 && r.round >= opts_.max_restarts
                                 ? fmt::format("; no restarts left (--max-restarts {})", opts_.max_restarts)
                                 : "";
      say(fmt::format("{}; {}{}", what, stopped, restarts));
      if (!store_lost_) publish_stop(what);
      return 1;
    }
  }

  std::string describe(const Round& r, const WorkerExit& e) const {
    return fmt::format("rank {} (local {}, pid {}) on node {} ({}) {}", e.global_rank, e.local_rank, e.pid, r.node_rank,
                       job_.host, describe_exit(e));
  }

  std::string lost_store_message(const std::string& why) const {
    return fmt::format(
        "lost the launcher's store at {}:{} ({}): this node is cut off from the job (link down?), or "
        "the launcher hosting the store has exited",
        ep_.store_addr, ep_.store_port, why);
  }

  // Called by the monitor every half second while the workers run.
  std::optional<std::string> check_remote(const Round& r, bool& no_restart) {
    try {
      if (auto f = rdzv_->failure(r.round)) {
        no_restart = no_restart || f->final;
        return f->what;
      }
      if (auto e = rdzv_->end()) {
        no_restart = true;
        return "the job was stopped: " + (e->size() > 2 ? e->substr(2) : *e);
      }
      if (auto lost = check_liveness(r)) {
        no_restart = no_restart || lost->final;
        return lost->what;
      }
      if (static_cast<int>(r.nodes.size()) < opts_.nnodes && r.round < opts_.max_restarts) {
        int64_t waiting = rdzv_->waiting(r.round);
        if (waiting > 0) {
          rdzv_->publish_failure(
              r.round, {fmt::format("{} new node(s) waiting to join (running {} of at most {} nodes); admitting them",
                                    waiting, r.nodes.size(), opts_.nnodes),
                        false});
          auto f = rdzv_->failure(r.round);
          no_restart = no_restart || f->final;
          return f->what;
        }
      }
      return std::nullopt;
    } catch (const std::exception& e) {
      store_lost_ = true;
      no_restart = true;
      return lost_store_message(e.what());
    }
  }

  // Reads the other nodes' heartbeats; publishes and returns a lost node.
  std::optional<RemoteFailure> check_liveness(const Round& r) {
    auto now = core::Clock::now();
    for (const RoundNode& n : r.nodes)
      if (n.agent != agent_) tracker_.observe(n.agent, store_->add(heartbeat_key(rdzv_->prefix(), n.agent), 0), now);
    std::vector<std::string> names;
    double silent = 0;
    for (long a : tracker_.lost(now))
      for (const RoundNode& n : r.nodes)
        if (n.agent == a) {
          names.push_back(fmt::format("node {} ({})", n.node_rank, n.host));
          silent = std::max(silent, tracker_.silent_for(a, now));
        }
    if (names.empty()) return std::nullopt;
    const int left = static_cast<int>(r.nodes.size() - names.size());
    const int need = min_nodes(opts_);
    std::string what = fmt::format(
        "lost {}: no heartbeat for {:.1f} s (its launcher was killed, its host is down or its network is cut; "
        "COHORT_HEARTBEAT_TIMEOUT={} s)",
        fmt::join(names, ", "), silent, knob_ms(kHeartbeatTimeout).count() / 1000.0);
    bool final = left < need;
    if (final)
      what += fmt::format("; {} node(s) left, but --nnodes {}:{} needs at least {}", left, need, opts_.nnodes, need);
    else
      what += fmt::format("; {} node(s) left", left);
    rdzv_->publish_failure(r.round, {what, final});
    return rdzv_->failure(r.round);
  }

  // This launcher ends the job for everyone (signal, failure without restarts).
  void publish_stop(const std::string& what) {
    if (!rdzv_ || store_lost_) return;
    try {
      if (round_ >= 0) rdzv_->publish_failure(round_, {what, true});
      rdzv_->publish_end("F " + what);
    } catch (const std::exception& e) {
      COHORT_WARN(kLaunch, "could not tell the other nodes that this one stopped: {}", e.what());
    }
  }

  // Leaves the job. The store's host first waits (bounded) until every other
  // launcher has left or is lost, so they can still read the outcome.
  void finish_up() {
    remove_shm_segments(cohort_run_id_);
    if (!rdzv_ || store_lost_) return;
    try {
      rdzv_->mark_left(agent_);
      if (!server_) return;
      LivenessTracker leaving(knob_ms(kHeartbeatTimeout));
      auto deadline = core::Deadline::after(knob_ms("COHORT_TERM_TIMEOUT") + std::chrono::seconds(30));
      for (;;) {
        auto now = core::Clock::now();
        std::vector<long> staying;
        const long agents = static_cast<long>(rdzv_->agent_count());
        for (long a = 1; a <= agents; ++a)
          if (a != agent_ && !rdzv_->has_left(a)) {
            leaving.observe(a, store_->add(heartbeat_key(rdzv_->prefix(), a), 0), now);
            staying.push_back(a);
          }
        std::vector<long> lost = leaving.lost(now);
        std::erase_if(staying, [&](long a) { return std::find(lost.begin(), lost.end(), a) != lost.end(); });
        if (staying.empty()) break;
        if (deadline.passed()) {
          COHORT_WARN(kLaunch, "{} launcher(s) did not confirm the outcome; closing the store anyway", staying.size());
          break;
        }
        if (int sig = signals_.wait_stop_signal(200)) {
          stopped_while_leaving_ = sig;
          break;
        }
      }
    } catch (const std::exception& e) {
      COHORT_WARN(kLaunch, "could not say goodbye through the store: {}", e.what());
    }
    heartbeat_.reset();
  }

  // The signal channel comes first: the store server's and heartbeat's threads inherit the blocked mask.
  SignalChannel signals_;
  const LaunchOptions& opts_;
  JobSetup job_;
  Endpoints ep_;
  std::unique_ptr<TcpStoreServer> server_;
  std::shared_ptr<Store> store_;
  std::unique_ptr<ElasticRendezvous> rdzv_;
  std::unique_ptr<Heartbeat> heartbeat_;
  LivenessTracker tracker_;
  int stopped_while_leaving_ = 0;
  std::string cohort_run_id_ = "job";
  long agent_ = 0;
  int round_ = -1;
  bool store_lost_ = false;
};

}  // namespace

int run_elastic_job(const LaunchOptions& opts) {
  ElasticAgent agent(opts);
  const int code = agent.run();
  // While the stop signals are still the agent's to read. One that came while
  // saying goodbye bounds the wait for the console like a stop does.
  return finish_console(agent.signals(), code, agent.stopped_while_leaving() != 0);
}

}  // namespace cohort::launch
