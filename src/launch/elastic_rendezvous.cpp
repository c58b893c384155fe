#include "launch/elastic_rendezvous.hpp"

#include <fmt/format.h>

#include <sstream>

#include "core/clock.hpp"
#include "core/log.hpp"
#include "launch/output.hpp"

namespace cohort::launch {
namespace {

using core::Clock;
using core::Deadline;

Bytes to_bytes(const std::string& s) {
  return Bytes(s.begin(), s.end());
}
std::string to_string(const Bytes& b) {
  return std::string(b.begin(), b.end());
}
double seconds(std::chrono::milliseconds ms) {
  return static_cast<double>(ms.count()) / 1000.0;
}

struct Registration {
  long agent = 0;
  std::string host;
  int nproc = 0, max_restarts = 0, min_nodes = 0, max_nodes = 0;
};

std::string encode(const Registration& r) {
  return fmt::format("{} {} {} {} {} {}", r.agent, r.host, r.nproc, r.max_restarts, r.min_nodes, r.max_nodes);
}

Registration decode(const std::string& text) {
  Registration r;
  std::istringstream in(text);
  in >> r.agent >> r.host >> r.nproc >> r.max_restarts >> r.min_nodes >> r.max_nodes;
  return r;
}

}  // namespace

void assign_ranks(std::vector<RoundNode>& nodes, int& world_size) {
  world_size = 0;
  for (size_t i = 0; i < nodes.size(); ++i) {
    nodes[i].node_rank = static_cast<int>(i);
    nodes[i].rank_base = world_size;
    world_size += nodes[i].nproc;
  }
}

ElasticRendezvous::ElasticRendezvous(Store& store, ElasticOptions opts, SignalChannel& signals)
    : store_(store), opts_(std::move(opts)), signals_(signals), prefix_("cohort/elastic/" + opts_.run_id + "/") {}

std::string ElasticRendezvous::round_key(int round, const std::string& name) const {
  return key(fmt::format("r{}/{}", round, name));
}

long ElasticRendezvous::register_agent() {
  return static_cast<long>(store_.add(key("agents"), 1));
}

int64_t ElasticRendezvous::agent_count() {
  return store_.add(key("agents"), 0);
}

std::string ElasticRendezvous::agree_run_id(const std::string& proposal) {
  return to_string(store_.compare_set(key("cohort_run_id"), {}, to_bytes(proposal)));
}

int ElasticRendezvous::current_round() {
  if (!store_.check({key("round")})) return 0;
  return std::stoi(store_.get_string(key("round")));
}

void ElasticRendezvous::open_round(int round) {
  for (;;) {
    Bytes now = store_.check({key("round")}) ? store_.get(key("round")) : Bytes{};
    int cur = now.empty() ? 0 : std::stoi(to_string(now));
    if (cur >= round) return;
    Bytes want = to_bytes(std::to_string(round));
    if (store_.compare_set(key("round"), now, want) == want) return;
  }
}

void ElasticRendezvous::sleep_or_throw(int ms) {
  int sig = signals_.wait_stop_signal(ms);
  if (sig != 0) throw Interrupted(sig);
}

void ElasticRendezvous::check_end() {
  std::optional<std::string> e = end();
  if (!e) return;
  if (*e == "ok") throw JobEnded("the job finished before this launcher could join it");
  throw JobEnded("the job was stopped before this launcher could join it: " + (e->size() > 2 ? e->substr(2) : *e));
}

Round ElasticRendezvous::join(long agent, int min_round, const std::function<std::pair<std::string, int>()>& master) {
  if (min_round > 0) open_round(min_round);
  int k = std::max(current_round(), min_round);
  const std::string nnodes = fmt::format("{}:{}", opts_.min_nodes, opts_.max_nodes);
  auto deadline = Deadline::after(opts_.join_timeout);
  Registration me{agent, opts_.host, opts_.nproc_per_node, opts_.max_restarts, opts_.min_nodes, opts_.max_nodes};
  int slot = -1, closed = -1;
  for (;;) {
    slot = static_cast<int>(store_.add(round_key(k, "count"), 1)) - 1;
    store_.set(round_key(k, fmt::format("node/{}", slot)), to_bytes(encode(me)));
    COHORT_INFO(kLaunch, "agent {} took slot {} of round {}", agent, slot, k);
    std::optional<Clock::time_point> min_seen;
    bool said_waiting = false;
    for (;;) {
      check_end();
      if (store_.check({round_key(k, "closed")})) {
        closed = std::stoi(store_.get_string(round_key(k, "closed")));
        break;
      }
      const bool open = current_round() >= k;
      int64_t count = store_.add(round_key(k, "count"), 0);
      if (open && count >= opts_.max_nodes) {
        store_.compare_set(round_key(k, "closed"), {}, to_bytes(std::to_string(opts_.max_nodes)));
        continue;
      }
      if (open && count >= opts_.min_nodes) {
        auto now = Clock::now();
        if (!min_seen) min_seen = now;
        if (now - *min_seen >= opts_.last_call) {
          store_.compare_set(round_key(k, "closed"), {}, to_bytes(std::to_string(count)));
          continue;
        }
      }
      if (!open && !said_waiting) {
        said_waiting = true;
        launcher_say(fmt::format("cohort run: the job is already running (round {}); this node waits to join round {}, "
                                 "which starts when the running nodes restart to admit it (they do while restarts "
                                 "are left)",
                                 k - 1, k));
      }
      if (deadline.passed()) {
        if (open)
          throw TimeoutError(fmt::format(
              "only {} node(s) joined round {} within {} s, but --nnodes {} needs at least {}: start `cohort run` "
              "with the same --rdzv-endpoint and --rdzv-id on the other hosts, check that the endpoint is "
              "reachable from them, or raise COHORT_RDZV_TIMEOUT",
              count, k, seconds(opts_.join_timeout), nnodes, opts_.min_nodes));
        throw TimeoutError(fmt::format(
            "waited {} s to join the running job, which did not restart to admit this node (no restarts left, or "
            "already --nnodes MAX nodes); raise --max-restarts or COHORT_RDZV_TIMEOUT",
            seconds(opts_.join_timeout)));
      }
      sleep_or_throw(deadline.remaining_ms(static_cast<int>(opts_.poll.count())));
    }
    if (slot < closed) break;
    launcher_say(fmt::format("cohort run: round {} closed with {} node(s) just before this node joined; waiting for "
                             "round {}",
                             k, closed, k + 1));
    ++k;
  }

  Round r;
  r.round = k;
  for (int i = 0; i < closed; ++i) {
    Registration other = decode(store_.get_string(round_key(k, fmt::format("node/{}", i)), std::chrono::seconds(30)));
    if (other.max_restarts != opts_.max_restarts)
      throw InvalidArgument(
          fmt::format("the launcher on {} has --max-restarts {} but this one ({}) has {}; give "
                      "every node the same value so they restart together",
                      other.host, other.max_restarts, opts_.host, opts_.max_restarts));
    if (other.min_nodes != opts_.min_nodes || other.max_nodes != opts_.max_nodes)
      throw InvalidArgument(
          fmt::format("the launcher on {} has --nnodes {}:{} but this one ({}) has {}; give every "
                      "node the same --nnodes",
                      other.host, other.min_nodes, other.max_nodes, opts_.host, nnodes));
    r.nodes.push_back(RoundNode{i, other.agent, other.host, other.nproc, 0});
  }
  assign_ranks(r.nodes, r.world_size);
  r.node_rank = slot;

  if (slot == 0) {
    auto [addr, port] = master();
    store_.set(round_key(k, "master"), to_bytes(fmt::format("{} {}", addr, port)));
  }
  while (!store_.check({round_key(k, "master")})) {
    check_end();
    if (auto f = failure(k); f && f->final) throw JobEnded("the job was stopped before round started: " + f->what);
    if (deadline.passed())
      throw TimeoutError(fmt::format("node rank 0 of round {} ({}) did not publish MASTER_ADDR within {} s", k,
                                     r.nodes[0].host, seconds(opts_.join_timeout)));
    sleep_or_throw(deadline.remaining_ms(static_cast<int>(opts_.poll.count())));
  }
  std::istringstream in(store_.get_string(round_key(k, "master")));
  in >> r.master_addr >> r.master_port;
  return r;
}

void ElasticRendezvous::publish_failure(int round, const RemoteFailure& f) {
  publish_failure_at(store_, round_key(round, "failed"), f);
}

std::optional<RemoteFailure> ElasticRendezvous::failure(int round) {
  return read_failure_at(store_, round_key(round, "failed"));
}

int64_t ElasticRendezvous::waiting(int round) {
  return store_.add(round_key(round + 1, "count"), 0);
}

void ElasticRendezvous::publish_end(const std::string& what) {
  store_.compare_set(key("end"), {}, to_bytes(what));
}

std::optional<std::string> ElasticRendezvous::end() {
  if (!store_.check({key("end")})) return std::nullopt;
  return store_.get_string(key("end"));
}

std::optional<RemoteFailure> ElasticRendezvous::finish(const Round& r,
                                                       const std::function<std::optional<RemoteFailure>()>& check) {
  store_.set(round_key(r.round, fmt::format("done/{}", r.node_rank)), to_bytes("ok"));
  auto deadline = Deadline::after(opts_.finish_timeout);
  for (;;) {
    if (auto f = failure(r.round)) return f;
    std::vector<int> running;
    for (const RoundNode& n : r.nodes)
      if (!store_.check({round_key(r.round, fmt::format("done/{}", n.node_rank))})) running.push_back(n.node_rank);
    if (running.empty()) return std::nullopt;
    if (check)
      if (auto f = check()) return f;
    if (deadline.passed())
      throw TimeoutError(fmt::format(
          "the workers of node(s) {} were still running {} s after this node's had finished; giving up on them "
          "(raise COHORT_RDZV_FINISH_TIMEOUT if nodes legitimately finish that far apart)",
          rank_list(running), seconds(opts_.finish_timeout)));
    sleep_or_throw(deadline.remaining_ms(static_cast<int>(opts_.poll.count())));
  }
}

void ElasticRendezvous::mark_left(long agent) {
  store_.set(key(fmt::format("left/{}", agent)), to_bytes("bye"));
}

bool ElasticRendezvous::has_left(long agent) {
  return store_.check({key(fmt::format("left/{}", agent))});
}

}  // namespace cohort::launch
