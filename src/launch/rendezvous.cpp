#include "launch/rendezvous.hpp"

#include <unistd.h>

#include <sstream>

#include <fmt/format.h>

#include "core/clock.hpp"
#include "core/log.hpp"
#include "launch/run_id.hpp"

namespace cohort::launch {
namespace {

using core::Deadline;

Bytes to_bytes(const std::string& s) { return Bytes(s.begin(), s.end()); }
std::string to_string(const Bytes& b) { return std::string(b.begin(), b.end()); }

// The nonce makes each launcher's registration unique even when host and pid
// coincide (containers), so compare_set tells a duplicate node rank apart.
std::string encode(const NodeInfo& n, const std::string& nonce) {
  return fmt::format("{} {} {} {} {}", n.host, n.pid, n.nproc_per_node, n.max_restarts, nonce);
}

NodeInfo decode(int node_rank, const std::string& text) {
  NodeInfo n;
  n.node_rank = node_rank;
  std::istringstream in(text);
  in >> n.host >> n.pid >> n.nproc_per_node >> n.max_restarts;
  return n;
}

double seconds(std::chrono::milliseconds ms) { return static_cast<double>(ms.count()) / 1000.0; }

}  // namespace

std::string rank_list(const std::vector<int>& ranks) { return fmt::format("{}", fmt::join(ranks, ", ")); }

StaticRendezvous::StaticRendezvous(Store& store, RendezvousOptions opts, SignalChannel& signals)
    : store_(store), opts_(std::move(opts)), signals_(signals), prefix_("cohort/launch/" + opts_.run_id + "/") {}

std::string StaticRendezvous::attempt_key(int attempt, const std::string& name) const {
  return key(fmt::format("a{}/{}", attempt, name));
}

std::vector<int> StaticRendezvous::missing(int attempt, const std::string& kind) {
  std::vector<int> out;
  for (int i = 0; i < opts_.nnodes; ++i)
    if (!store_.check({attempt_key(attempt, fmt::format("{}/{}", kind, i))})) out.push_back(i);
  return out;
}

void StaticRendezvous::sleep_or_throw(int ms) {
  int sig = signals_.wait_stop_signal(ms);
  if (sig != 0) throw Interrupted(sig);
}

std::vector<NodeInfo> StaticRendezvous::join(int attempt, std::string& cohort_run_id) {
  last_attempt_ = attempt;
  if (opts_.node_rank == 0 && attempt == 0) store_.set(key("cohort_run_id"), to_bytes(cohort_run_id));

  NodeInfo me{opts_.node_rank, opts_.host, static_cast<long>(getpid()), opts_.nproc_per_node, opts_.max_restarts};
  Bytes mine = to_bytes(encode(me, random_hex(16)));
  Bytes now = store_.compare_set(attempt_key(attempt, fmt::format("node/{}", opts_.node_rank)), {}, mine);
  if (now != mine) {
    NodeInfo other = decode(opts_.node_rank, to_string(now));
    throw InvalidArgument(fmt::format("node rank {} is already taken by the launcher on {} (pid {}); give each "
                                      "launcher its own --node-rank in 0..{}",
                                      opts_.node_rank, other.host, other.pid, opts_.nnodes - 1));
  }
  COHORT_INFO(kLaunch, "node {} joined attempt {}; waiting for {} node(s)", opts_.node_rank, attempt, opts_.nnodes);

  auto deadline = Deadline::after(opts_.join_timeout);
  std::vector<int> absent = missing(attempt, "node");
  while (!absent.empty()) {
    if (deadline.passed())
      throw TimeoutError(fmt::format(
          "node(s) {} did not join within {} s (--nnodes {}): start `cohort run` with --node-rank {} on those "
          "hosts with the same --master-addr/--rdzv-endpoint, check that this address is reachable from them, or "
          "raise COHORT_RDZV_TIMEOUT",
          rank_list(absent), seconds(opts_.join_timeout), opts_.nnodes, rank_list(absent)));
    sleep_or_throw(deadline.remaining_ms(static_cast<int>(opts_.poll.count())));
    if (auto f = failure(attempt); f && f->final) throw PeerError("the job was stopped before it started: " + f->what, -1);
    absent = missing(attempt, "node");
  }

  std::vector<NodeInfo> nodes;
  for (int i = 0; i < opts_.nnodes; ++i) {
    NodeInfo n = decode(i, store_.get_string(attempt_key(attempt, fmt::format("node/{}", i))));
    if (n.nproc_per_node != opts_.nproc_per_node)
      throw InvalidArgument(fmt::format("node {} ({}) runs --nproc-per-node {} but this node ({}) runs {}; every node "
                                        "must run the same number of workers for now",
                                        i, n.host, n.nproc_per_node, opts_.node_rank, opts_.nproc_per_node));
    if (n.max_restarts != opts_.max_restarts)
      throw InvalidArgument(fmt::format("node {} ({}) has --max-restarts {} but this node has {}; give every node "
                                        "the same value so they restart together",
                                        i, n.host, n.max_restarts, opts_.max_restarts));
    nodes.push_back(n);
  }
  if (opts_.node_rank != 0 && attempt == 0) cohort_run_id = store_.get_string(key("cohort_run_id"));
  return nodes;
}

void publish_failure_at(Store& store, const std::string& key, const RemoteFailure& f) {
  store.compare_set(key, {}, to_bytes((f.final ? "F " : "R ") + f.what));
}

std::optional<RemoteFailure> read_failure_at(Store& store, const std::string& key) {
  if (!store.check({key})) return std::nullopt;
  std::string v = store.get_string(key);
  return RemoteFailure{v.size() >= 2 ? v.substr(2) : v, v.rfind("F ", 0) == 0};
}

void StaticRendezvous::publish_failure(int attempt, const RemoteFailure& failure) {
  publish_failure_at(store_, attempt_key(attempt, "failed"), failure);
}

std::optional<RemoteFailure> StaticRendezvous::failure(int attempt) {
  return read_failure_at(store_, attempt_key(attempt, "failed"));
}

std::optional<RemoteFailure> StaticRendezvous::finish(int attempt) {
  store_.set(attempt_key(attempt, fmt::format("done/{}", opts_.node_rank)), to_bytes("ok"));
  auto deadline = Deadline::after(opts_.finish_timeout);
  for (;;) {
    if (auto f = failure(attempt)) return f;
    std::vector<int> running = missing(attempt, "done");
    if (running.empty()) return std::nullopt;
    if (deadline.passed())
      throw TimeoutError(fmt::format(
          "the workers of node(s) {} were still running {} s after this node's had finished; giving up on them "
          "(raise COHORT_RDZV_FINISH_TIMEOUT if nodes legitimately finish that far apart)",
          rank_list(running), seconds(opts_.finish_timeout)));
    sleep_or_throw(deadline.remaining_ms(static_cast<int>(opts_.poll.count())));
  }
}

void StaticRendezvous::leave() {
  try {
    store_.set(key(fmt::format("left/{}", opts_.node_rank)), to_bytes("bye"));
    if (opts_.node_rank != 0 || last_attempt_ < 0) return;
    // Wait only for the nodes that joined the last attempt: the others never
    // reached the store, or left it when their own rendezvous failed.
    std::vector<int> joined;
    for (int i = 1; i < opts_.nnodes; ++i)
      if (store_.check({attempt_key(last_attempt_, fmt::format("node/{}", i))})) joined.push_back(i);
    auto deadline = Deadline::after(opts_.leave_timeout);
    for (;;) {
      std::vector<int> staying;
      for (int i : joined)
        if (!store_.check({key(fmt::format("left/{}", i))})) staying.push_back(i);
      if (staying.empty()) return;
      if (deadline.passed()) {
        COHORT_WARN(kLaunch, "node(s) {} did not confirm the outcome within {} s; closing the store anyway",
                    rank_list(staying), seconds(opts_.leave_timeout));
        return;
      }
      if (signals_.wait_stop_signal(deadline.remaining_ms(static_cast<int>(opts_.poll.count()))) != 0) return;
    }
  } catch (const std::exception& e) {
    COHORT_WARN(kLaunch, "could not say goodbye through the store: {}", e.what());
  }
}

}  // namespace cohort::launch
