// NativeGroup: the ProcessGroup of cohort's own transports (the table in
// transport/registry.hpp: shared memory on a host, TCP between hosts).
//
// Threads: the caller issues operations (from one thread at a time); each is
// validated at once, numbered, and queued. A progress thread, started on the
// first queued operation, executes them in order. An operation of at most
// COHORT_INLINE_BYTES that finds the queue empty runs inline on the caller's
// thread instead: no hand-off, which is what a small allreduce's latency needs.
//
// Failure: the first failed operation aborts every connection (so that peers
// fail fast instead of waiting for their timeout) and breaks the group: later
// operations fail at once with the original error.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "cohort/process_group.hpp"
#include "collectives/comm.hpp"
#include "collectives/host_layout.hpp"
#include "collectives/tuner.hpp"
#include "group/flight_recorder.hpp"
#include "group/op.hpp"
#include "group/work.hpp"
#include "transport/engine.hpp"
#include "transport/registry.hpp"

namespace cohort::group {

struct GroupSetup {
  int rank = 0;
  int size = 1;
  std::vector<int> world_ranks;  // world rank of each group rank
  std::shared_ptr<Store> store;  // already prefixed for this group
  std::shared_ptr<Store> root_store;  // the world's store (sub-groups prefix it again)
  std::string group_id;          // "0" for the world, "0.1", ... for sub-groups
  std::string run_id;
  Millis timeout{300000};
  std::string transport;         // "", "shm" or "tcp"
  std::string route_hint;        // host to route TCP towards (the store's host)
  // Ranks of the job that share this host's CPUs: the launcher's
  // LOCAL_WORLD_SIZE, 0 when it did not say. connect() raises it to the
  // group's own count of ranks on this machine (the same hostname and boot,
  // any network namespace), and sub-groups inherit it, so a pair of ranks
  // still knows that 8 share 2 cores.
  int host_ranks = 0;
};

class NativeGroup final : public ProcessGroup, public WorkRunner, public std::enable_shared_from_this<NativeGroup> {
 public:
  // Connects to every peer (collective over the group's ranks).
  static std::shared_ptr<NativeGroup> create(GroupSetup setup);
  ~NativeGroup() override;

  int rank() const override { return setup_.rank; }
  int size() const override { return setup_.size; }
  std::string backend_name() const override { return "native"; }
  const std::vector<int>& world_ranks() const override { return setup_.world_ranks; }

  WorkPtr allreduce(Buffer send, Buffer recv, AllreduceOptions opts) override;
  WorkPtr allreduce_gathered(Buffer buf, std::vector<InputPiece> pieces, AllreduceOptions opts) override;
  std::pair<size_t, size_t> allreduce_direct_block(size_t count, DType dtype) const override;
  WorkPtr broadcast(Buffer buf, BroadcastOptions opts) override;
  WorkPtr reduce(Buffer send, Buffer recv, ReduceOptions opts) override;
  WorkPtr allgather(Buffer send, Buffer recv, AllgatherOptions opts) override;
  WorkPtr reduce_scatter(Buffer send, Buffer recv, ReduceScatterOptions opts) override;
  WorkPtr gather(Buffer send, Buffer recv, GatherOptions opts) override;
  WorkPtr scatter(Buffer send, Buffer recv, ScatterOptions opts) override;
  WorkPtr alltoall(Buffer send, Buffer recv, AlltoallOptions opts) override;
  WorkPtr barrier(BarrierOptions opts) override;
  WorkPtr send(Buffer buf, int dst, SendRecvOptions opts) override;
  WorkPtr recv(Buffer buf, int src, SendRecvOptions opts) override;
  WorkPtr batch_isend_irecv(const std::vector<P2POp>& ops, Millis timeout) override;
  std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks) override;
  std::shared_ptr<std::byte[]> allocate_buffer(size_t bytes) override;
  void shutdown() override;
  bool run_if_next(WorkImpl* w) override;

  // Which transport reaches each peer ("shm", "tcp", "self"), for logs and tests.
  std::string transport_of(int peer) const;
  // What the tuner sees for a collective of `tuner_bytes` (tuner.hpp's
  // TunerInput.bytes), and the thresholds it uses: `cohort bench --calibrate`
  // records the algorithm each measurement ran.
  collectives::TunerInput tuner_input(collectives::Coll c, size_t tuner_bytes) const;
  const collectives::Thresholds& thresholds() const { return thresholds_; }
  size_t pipeline_segment() const { return pipeline_segment_; }

 private:
  explicit NativeGroup(GroupSetup setup);
  void connect();
  void log_peers(const std::vector<std::string>& hosts);  // INFO, group_setup.cpp
  WorkPtr submit(OpDesc d);
  void execute(OpDesc& d);       // on the progress thread or inline
  // Runs d with mu_ held by lk on entry and exit (released while it runs); completes w.
  void run_locked(std::unique_lock<std::mutex>& lk, OpDesc& d, WorkImpl& w);
  void run_algorithm(OpDesc& d);
  void run_allreduce(OpDesc& d, collectives::Algo a, bool shared_only, core::Deadline deadline);
  bool host_single_copy(size_t total_bytes) const;
  // The algorithm for d, and whether COHORT_ALGO chose it (false also when
  // it asked for hierarchical where the group cannot run it).
  std::pair<collectives::Algo, bool> pick_algorithm(const OpDesc& d);
  // COHORT_ALGO's algorithm where this group can run hierarchical, else the
  // tuner's choice; second: COHORT_ALGO's was taken.
  std::pair<collectives::Algo, bool> algorithm_for(const collectives::TunerInput& in) const;
  void begin_views(const collectives::Comm& comm, core::Deadline deadline);  // local_comm_, cross_comm_ as comm
  void run_p2p(OpDesc& d, core::Deadline deadline);
  void progress_loop();
  [[noreturn]] void fail(const OpDesc& d, std::exception_ptr cause);
  // compare_set of the group's "failure" key: returns the first failure recorded (maybe ours).
  std::string record_first_failure(const std::string& why);
  // Hang diagnosis (native_group_diag.cpp): the heartbeat, from the progress
  // thread while idle, and the verdict on a timed-out collective.
  void publish_heartbeat();
  std::string hang_verdict(const OpDesc& d);

  GroupSetup setup_;
  std::vector<std::unique_ptr<transport::Links>> links_;  // one per transport in use (transport/registry.hpp)
  std::vector<int> link_of_;                              // peer -> its index in links_ (-1: self)
  std::vector<std::unique_ptr<transport::Connection>> conns_;
  std::unique_ptr<transport::Engine> engine_;
  std::unique_ptr<collectives::Comm> comm_;
  // The host layout, and when the node-aware algorithms can run on it
  // (hier_why_ empty), views of comm_ over this host's ranks and over the
  // ranks with this rank's local index on every host.
  collectives::HostLayout layout_;
  std::string hier_why_ = "every rank of the group is on one host";
  std::unique_ptr<collectives::Comm> local_comm_, cross_comm_;
  bool local_single_copy_ = false;  // ... and local_comm_'s links allow single copy (shm, ShmTransport::single_copy)
  bool hier_warned_ = false;  // COHORT_ALGO forced hierarchical where it cannot run: said once
  bool all_shm_ = true;
  bool single_copy_ = false;            // all_shm_ and the shm transport allows single copy
  std::string single_copy_why_;         // why not, when it does not
  size_t inline_max_ = 0;
  size_t pipeline_segment_ = 0;
  collectives::Thresholds thresholds_;  // the tuner's, with the knobs applied at construction

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<OpDesc, std::shared_ptr<WorkImpl>>> queue_;
  bool busy_ = false;
  bool stopping_ = false;
  std::thread thread_;
  uint64_t next_seq_ = 0;      // collectives
  uint64_t next_p2p_seq_ = 0;  // send, recv, batches (numbered apart: see submit)
  std::vector<uint64_t> p2p_sent_, p2p_recvd_;
  std::exception_ptr broken_;
  int subgroups_ = 0;
  FlightRecorder recorder_{FlightRecorder::configured_entries()};
  int64_t heartbeat_ms_ = recorder_.enabled() ? FlightRecorder::configured_heartbeat_ms() : 0;
  int64_t last_heartbeat_ns_ = 0;  // when it was published (FlightRecorder::now_ns; progress thread only)
  bool heartbeat_failed_ = false;  // the store refused one: no more (progress thread only)
};

}  // namespace cohort::group
