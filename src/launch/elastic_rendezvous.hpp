// Dynamic ("c10d") rendezvous over the launcher's store: launchers started in
// any order, on any hosts, meet in numbered rounds; each round closes with
// between --nnodes MIN and MAX nodes and assigns node ranks and global ranks.
// Round k runs the workers with TORCHELASTIC_RESTART_COUNT = k.
//
// Keys, under "cohort/elastic/<run_id>/":
//   agents            counter: each launcher takes an agent id (1, 2, ...) once
//   hb/<agent>        that launcher's heartbeat counter (liveness.hpp)
//   left/<agent>      that launcher is exiting and needs the store no more
//   cohort_run_id     COHORT_RUN_ID of the job (first launcher's proposal wins)
//   round             the newest open round, k (missing = 0)
//   r<k>/count        counter: join order within round k (slot = count - 1)
//   r<k>/node/<slot>  "agent host nproc max_restarts min max" of the slot's launcher
//   r<k>/closed       how many slots made it into round k (first writer wins)
//   r<k>/master       "addr port" of MASTER_ADDR / MASTER_PORT, set by node rank 0
//   r<k>/failed       first failure of round k: "R what" (restartable) or "F what"
//   r<k>/done/<i>     node rank i's workers all exited 0
//   end               the job is over: "ok", or "F what"
//
// How a round closes: a launcher takes the next slot of the newest round. Once
// the round is open and at least MIN slots are taken, any member closes it as
// soon as MAX are there, or when its last-call window (COHORT_RDZV_LAST_CALL)
// has passed since it first saw MIN: compare_set(closed, count it read). Slots
// below that number are in, node rank = slot; later slots (late arrivals) go on
// to round k+1, which opens only when the running nodes restart. A launcher
// that registered for round k+1 while round k runs is a "waiting" node: the
// running nodes see it (waiting()) and restart to admit it.
//
// Main thread only. Waits poll the store every `poll` and the SignalChannel, so
// a stop signal is seen at once (throws Interrupted, see rendezvous.hpp).
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cohort/store.hpp"
#include "launch/process.hpp"
#include "launch/rendezvous.hpp"

namespace cohort::launch {

// The job ended (finished or was stopped) while this launcher waited to join.
class JobEnded : public Error {
 public:
  explicit JobEnded(const std::string& what) : Error(what) {}
};

struct ElasticOptions {
  std::string run_id = "none";
  int min_nodes = 1;
  int max_nodes = 1;
  int nproc_per_node = 1;
  int max_restarts = 0;
  std::string host;                                  // this launcher's hostname, for messages
  std::chrono::milliseconds last_call{10000};        // COHORT_RDZV_LAST_CALL
  std::chrono::milliseconds join_timeout{600000};    // COHORT_RDZV_TIMEOUT
  std::chrono::milliseconds finish_timeout{300000};  // COHORT_RDZV_FINISH_TIMEOUT
  std::chrono::milliseconds poll{200};
};

struct RoundNode {
  int node_rank = 0;
  long agent = 0;
  std::string host;
  int nproc = 0;
  int rank_base = 0;  // global rank of its local rank 0
};

struct Round {
  int round = 0;  // = TORCHELASTIC_RESTART_COUNT of its workers
  int node_rank = 0;
  std::vector<RoundNode> nodes;
  int world_size = 0;
  std::string master_addr;
  int master_port = 0;
  const RoundNode& me() const { return nodes.at(static_cast<size_t>(node_rank)); }
};

// Pure: node ranks in slot order, rank bases as prefix sums of nproc.
void assign_ranks(std::vector<RoundNode>& nodes, int& world_size);

class ElasticRendezvous {
 public:
  ElasticRendezvous(Store& store, ElasticOptions opts, SignalChannel& signals);

  const std::string& prefix() const { return prefix_; }
  // Takes this launcher's agent id (once).
  long register_agent();
  // The job's COHORT_RUN_ID: `proposal` unless another launcher proposed first.
  std::string agree_run_id(const std::string& proposal);

  // Joins round `min_round` (opening it: this launcher restarts after round
  // min_round - 1), or the newest round if that is later, and waits until the
  // round closes with this launcher in it. `master` is called on node rank 0 to
  // pick MASTER_ADDR / MASTER_PORT. `on_wait` is called every poll while waiting
  // (heartbeats, messages). Throws TimeoutError (not enough nodes within
  // join_timeout, saying how many came), InvalidArgument (mismatched
  // --max-restarts / --nnodes across launchers), JobEnded, Interrupted.
  Round join(long agent, int min_round, const std::function<std::pair<std::string, int>()>& master);

  void publish_failure(int round, const RemoteFailure& failure);
  std::optional<RemoteFailure> failure(int round);
  // Launchers registered for round + 1 while round runs (late arrivals).
  int64_t waiting(int round);
  void publish_end(const std::string& what);  // "ok" or "F ..."; first wins
  std::optional<std::string> end();

  // This node's workers all succeeded in `round`: publishes that and waits for
  // every node's, or a failure (returned), calling `check` every poll (liveness;
  // a failure it returns is returned). TimeoutError after finish_timeout.
  std::optional<RemoteFailure> finish(const Round& round, const std::function<std::optional<RemoteFailure>()>& check);

  void mark_left(long agent);
  bool has_left(long agent);
  int64_t agent_count();

 private:
  std::string key(const std::string& name) const { return prefix_ + name; }
  std::string round_key(int round, const std::string& name) const;
  int current_round();
  void open_round(int round);
  void sleep_or_throw(int ms);
  void check_end();

  Store& store_;
  ElasticOptions opts_;
  SignalChannel& signals_;
  std::string prefix_;
};

}  // namespace cohort::launch
