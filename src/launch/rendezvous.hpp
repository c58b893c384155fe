// Static multi-node rendezvous over the launcher's store (--nnodes N, fixed).
//
// Node 0's launcher hosts the store; every launcher (node 0 included) is a
// client. Keys live under "cohort/launch/<run_id>/" and, per attempt k (the
// restart count), under ".../a<k>/":
//   cohort_run_id    the job's COHORT_RUN_ID, written by node 0 before it joins
//   a<k>/node/<i>    "host pid nproc max_restarts nonce" of node i (first writer wins:
//                    a second launcher with the same --node-rank is refused)
//   a<k>/failed      the first failure of attempt k: "R " (restartable) or "F "
//                    (final: a launcher was stopped) and one line (first wins)
//   a<k>/done/<i>    node i's workers all exited 0
//   left/<i>         node i's launcher is exiting and needs the store no more
// A launcher joins attempt k, runs its workers while watching a<k>/failed, then
// either publishes its own failure or waits for every node's done. After a
// failure every launcher moves to attempt k+1 while restarts remain, so all
// nodes restart together. Node 0 keeps the store up until every node has left
// (bounded).
//
// Waits poll the store every `poll` and the SignalChannel meanwhile, so Ctrl-C
// stays prompt; a stop signal throws Interrupted. Main thread only.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "cohort/error.hpp"
#include "cohort/store.hpp"
#include "launch/process.hpp"

namespace cohort::launch {

// A stop signal arrived while the launcher was waiting on other nodes.
class Interrupted : public Error {
 public:
  explicit Interrupted(int sig) : Error("interrupted by " + signal_name(sig)), signal_(sig) {}
  int signal() const { return signal_; }

 private:
  int signal_;
};

struct NodeInfo {
  int node_rank = 0;
  std::string host;
  long pid = 0;
  int nproc_per_node = 0;
  int max_restarts = 0;
};

// Another node's failure, as published.
struct RemoteFailure {
  std::string what;
  bool final = false;  // a launcher left the job: restarting cannot help
};

// A round's failure in the store, shared by the static and the elastic
// rendezvous: the first publisher wins ("F what" when final, "R what" else).
void publish_failure_at(Store& store, const std::string& key, const RemoteFailure& f);
std::optional<RemoteFailure> read_failure_at(Store& store, const std::string& key);

struct RendezvousOptions {
  std::string run_id = "none";  // TORCHELASTIC_RUN_ID: namespaces the keys
  int nnodes = 1;
  int node_rank = 0;
  int nproc_per_node = 1;
  int max_restarts = 0;
  std::string host;             // this node's hostname, for messages
  std::chrono::milliseconds join_timeout{600000};    // COHORT_RDZV_TIMEOUT
  std::chrono::milliseconds finish_timeout{300000};  // COHORT_RDZV_FINISH_TIMEOUT
  std::chrono::milliseconds leave_timeout{30000};    // node 0 waiting for the others to leave
  std::chrono::milliseconds poll{250};
};

class StaticRendezvous {
 public:
  StaticRendezvous(Store& store, RendezvousOptions opts, SignalChannel& signals);

  // Registers this node for attempt k and waits until all nodes have. Returns
  // them by node rank. Node 0 decides `cohort_run_id` (at attempt 0); the others
  // read it into `cohort_run_id`. Throws TimeoutError naming the missing node
  // ranks, InvalidArgument for a duplicate node rank or a mismatched
  // --nproc-per-node / --max-restarts, PeerError when a launcher that already
  // joined left the job (a final failure).
  std::vector<NodeInfo> join(int attempt, std::string& cohort_run_id);

  // Publishes this node's failure of attempt k; the first publication wins.
  void publish_failure(int attempt, const RemoteFailure& failure);
  // The failure of attempt k, if one was published. Two store round trips.
  std::optional<RemoteFailure> failure(int attempt);

  // This node's workers all succeeded: publishes that and waits until every node
  // has (nullopt) or one failed. TimeoutError names the nodes that did not
  // finish within finish_timeout.
  std::optional<RemoteFailure> finish(int attempt);

  // This launcher is exiting. Node 0 first waits (up to leave_timeout, or a stop
  // signal) for the nodes that joined to leave, so they can still read the
  // outcome. Never throws.
  void leave();

 private:
  std::string key(const std::string& name) const { return prefix_ + name; }
  std::string attempt_key(int attempt, const std::string& name) const;
  // Node ranks whose attempt_key(attempt, kind + "/" + i) is missing.
  std::vector<int> missing(int attempt, const std::string& kind);
  void sleep_or_throw(int ms);

  Store& store_;
  RendezvousOptions opts_;
  SignalChannel& signals_;
  std::string prefix_;
  int last_attempt_ = -1;
};

// "1, 3" for the messages.
std::string rank_list(const std::vector<int>& ranks);

}  // namespace cohort::launch
