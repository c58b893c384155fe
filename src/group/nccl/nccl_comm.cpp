// NcclComm: communicator set-up (unique id through the store, non-blocking
// init and split), enqueueing, health checks, failure and shutdown.
#include "group/nccl/nccl_comm.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "core/log.hpp"

namespace cohort::group::nccl {
namespace {

constexpr auto kStoreCheckEvery = std::chrono::seconds(1);

ncclConfig_t nonblocking_config() {
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  return cfg;
}

}  // namespace

std::shared_ptr<NcclComm> NcclComm::init(const GroupSetup& setup, int device) {
  std::shared_ptr<NcclComm> c(new NcclComm(setup, device));
  DeviceGuard guard(device);
  const auto deadline = core::Deadline::after(setup.timeout);
  auto& store = *setup.store;
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (setup.rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) {
      std::string why = fmt::format("rank 0 failed in ncclGetUniqueId: {}", nccl_error_text(r, nullptr));
      c->record_first_failure(why);
      throw Error(fmt::format(
          "{}; HINT: NCCL_DEBUG=INFO shows why (often no usable network interface: NCCL_SOCKET_IFNAME)", why));
    }
    store.set("nccl_id",
              Bytes(reinterpret_cast<const uint8_t*>(&id), reinterpret_cast<const uint8_t*>(&id) + sizeof(id)));
  } else {
    Bytes b = store.get("nccl_id", Millis(std::max(1, deadline.remaining_ms())));
    if (b.size() != sizeof(id))
      throw Error(
          fmt::format("rank {}: the NCCL unique id in the store has {} bytes, expected {}; HINT: every rank must run "
                      "the same cohort build",
                      setup.rank, b.size(), sizeof(id)));
    std::memcpy(&id, b.data(), sizeof(id));
  }

  ncclConfig_t cfg = nonblocking_config();
  ncclResult_t r = ncclCommInitRankConfig(&c->comm_, setup.size, id, setup.rank, &cfg);
  std::string peer_failure;
  if (r == ncclSuccess || r == ncclInProgress) r = c->wait_ready(c->comm_, true, deadline, &peer_failure);
  if (r != ncclSuccess) {
    std::string why;
    if (!peer_failure.empty())
      why = fmt::format("another rank failed while this one waited in ncclCommInitRankConfig: {}", peer_failure);
    else if (r == ncclInProgress)
      why = fmt::format("ncclCommInitRankConfig did not finish within {} ms", setup.timeout.count());
    else
      why = fmt::format("ncclCommInitRankConfig failed: {}", nccl_error_text(r, c->comm_));
    if (c->comm_ != nullptr) (void)ncclCommAbort(c->comm_);
    c->comm_ = nullptr;
    c->aborted_ = true;
    c->shut_ = true;
    if (peer_failure.empty()) c->record_first_failure(fmt::format("rank {} (GPU {}): {}", setup.rank, device, why));
    std::string msg = fmt::format(
        "rank {} of {} (group {}, GPU {}): NCCL communicator set-up failed: {}; HINT: every rank "
        "must call init_process_group with backend nccl; NCCL_DEBUG=INFO shows how ranks connect",
        setup.rank, setup.size, setup.group_id, device, why);
    if (r == ncclInProgress) throw TimeoutError(msg);
    if (!peer_failure.empty() || r == ncclRemoteError) throw PeerError(msg, -1);
    throw Error(msg);
  }
  c->make_stream();
  COHORT_INFO(kInit, "group {}: rank {}/{} NCCL communicator ready on GPU {}", setup.group_id, setup.rank, setup.size,
              device);
  return c;
}

std::shared_ptr<NcclComm> NcclComm::split(const GroupSetup& child, bool member, int key) {
  std::unique_lock<std::mutex> lk(mu_);
  if (broken_ || comm_ == nullptr)
    throw Error(fmt::format("rank {}: new_group: this group failed or was shut down before the split", setup_.rank));
  DeviceGuard guard(device_);
  std::shared_ptr<NcclComm> c(new NcclComm(child, device_));
  ncclConfig_t cfg = nonblocking_config();
  // NCCL writes the new handle only when the split has completed, from its
  // own thread (init.cc: "*newcomm should be NCCL_COMM_NULL until comm split
  // fully complete"). The slot therefore lives on the heap, and is leaked if
  // we give up before then, so that a late write cannot land in freed memory.
  auto* slot = new ncclComm_t(nullptr);
  ncclResult_t r = ncclCommSplit(comm_, member ? 0 : NCCL_SPLIT_NOCOLOR, key, slot, &cfg);
  lk.unlock();
  const auto deadline = core::Deadline::after(setup_.timeout);
  std::string peer_failure;
  // First the parent, until the split leaves ncclInProgress (then the handle
  // is written); then the member's new communicator, until its own set-up ends.
  if (r == ncclSuccess || r == ncclInProgress) r = wait_ready(nullptr, true, deadline, &peer_failure);
  if (r == ncclSuccess) {
    c->comm_ = *slot;
    delete slot;
    slot = nullptr;
    if (c->comm_ != nullptr)
      r = wait_ready(c->comm_, false, deadline, &peer_failure);
    else if (member)
      r = ncclInternalError;  // completed without a communicator for a member: never expected
  }
  if (r != ncclSuccess) {
    if (c->comm_ != nullptr) (void)ncclCommAbort(c->comm_);
    c->comm_ = nullptr;
    c->aborted_ = c->shut_ = true;
    std::string what = !peer_failure.empty() ? "another rank failed: " + peer_failure
                       : r == ncclInProgress
                           ? fmt::format("ncclCommSplit did not finish within {} ms", setup_.timeout.count())
                           : "ncclCommSplit failed: " + nccl_error_text(r, nullptr);
    const char kind = r == ncclInProgress ? 't' : (peer_failure.empty() && r != ncclRemoteError ? 'e' : 'p');
    fail(fmt::format("new_group (sub-group {})", child.group_id), kind, what);  // the parent is broken too
  }
  if (!member) return nullptr;
  c->make_stream();
  return c;
}

NcclComm::~NcclComm() {
  shutdown();
}

void NcclComm::make_stream() {
  DeviceGuard guard(device_);
  check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
             "cudaStreamCreateWithFlags for the NCCL stream");
  check_cuda(cudaEventCreateWithFlags(&caller_ready_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
}

ncclResult_t NcclComm::wait_ready(ncclComm_t c, bool own, core::Deadline deadline, std::string* peer_failure) {
  ncclResult_t state = ncclInProgress;
  poll_until(deadline, [&] {
    {
      std::lock_guard<std::mutex> g(mu_);
      ncclComm_t q = own ? comm_ : c;
      if (own && (aborted_ || q == nullptr)) {
        state = ncclInvalidUsage;  // aborted by another thread's failure
        return true;
      }
      ncclResult_t r = ncclCommGetAsyncError(q, &state);
      if (r != ncclSuccess) state = r;
    }
    if (state != ncclInProgress) return true;
    std::string f = poll_store_failure();
    if (f.empty()) return false;
    *peer_failure = f;
    state = ncclRemoteError;
    return true;
  });
  return state;
}

std::string NcclComm::poll_store_failure() {
  // Any thread may get here (several may wait on works of this group): the
  // slot is claimed with a compare-exchange on the next check's time.
  const int64_t now = core::Clock::now().time_since_epoch().count();
  int64_t due = next_store_check_.load(std::memory_order_relaxed);
  const int64_t next = (core::Clock::now() + kStoreCheckEvery).time_since_epoch().count();
  if (now < due || !next_store_check_.compare_exchange_strong(due, next)) return {};
  try {
    if (!setup_.store->check({"failure"})) return {};
    Bytes b = setup_.store->get("failure", Millis(1000));
    return std::string(b.begin(), b.end());
  } catch (const std::exception& e) {
    // The store's host may be gone too; NCCL's own error or our deadline will tell.
    COHORT_TRACE(kColl, "could not read the group's failure key: {}", e.what());
    return {};
  }
}

WorkPtr NcclComm::issue(OpDesc d, const std::function<ncclResult_t(ncclComm_t, cudaStream_t)>& enqueue) {
  {
    // Fail fast: an asynchronous NCCL error or another rank's recorded failure
    // breaks the group now, instead of queueing more work behind a hung kernel.
    OpDesc probe = d;
    {
      std::lock_guard<std::mutex> g(mu_);
      probe.seq = next_seq_;
    }
    check_health(probe);
  }
  std::unique_lock<std::mutex> lk(mu_);
  if (broken_) {
    try {
      std::rethrow_exception(broken_);
    } catch (const Error& e) {
      throw Error(
          fmt::format("rank {}: {} not started: this group failed earlier: {}", setup_.rank, d.describe(), e.what()));
    }
  }
  if (shut_ || comm_ == nullptr)
    throw Error(fmt::format("{}: the process group was shut down", collectives::coll_name(d.coll)));
  d.seq = next_seq_++;
  const Millis timeout = d.timeout.count() > 0 ? d.timeout : setup_.timeout;
  const auto deadline = core::Deadline::after(timeout);
  DeviceGuard guard(device_);
  // The caller's stream (CudaStreamScope: LibTorch's current stream under
  // DDP), else the legacy default stream.
  void* scoped = CudaStreamScope::current();
  cudaStream_t caller = scoped != nullptr ? static_cast<cudaStream_t>(scoped) : cudaStreamLegacy;
  cudaError_t ce = cudaEventRecord(caller_ready_, caller);
  if (ce == cudaSuccess) ce = cudaStreamWaitEvent(stream_, caller_ready_, 0);
  if (ce != cudaSuccess) {
    (void)cudaGetLastError();
    lk.unlock();
    fail(d, 'e', "ordering after the caller's stream failed: " + cuda_error_text(ce));
  }
  ncclResult_t r = enqueue(comm_, stream_);
  const ncclResult_t immediate = r;
  lk.unlock();
  std::string peer_failure;
  if (r == ncclInProgress) r = wait_ready(nullptr, true, deadline, &peer_failure);
  if (r != ncclSuccess) {
    if (!peer_failure.empty()) fail(d, 'p', "another rank failed first: " + peer_failure);
    if (r == ncclInProgress)
      fail(d, 't', fmt::format("NCCL did not finish enqueueing it within {} ms", timeout.count()));
    std::string text;
    {
      std::lock_guard<std::mutex> g(mu_);
      text = nccl_error_text(r, comm_);
    }
    if (immediate == ncclInvalidArgument)  // NCCL checked the arguments: nothing was enqueued, the group stays usable
      throw InvalidArgument(
          fmt::format("rank {}: {}: NCCL rejected the arguments: {}", setup_.rank, d.describe(), text));
    fail(d, r == ncclRemoteError ? 'p' : 'e', "NCCL failed to enqueue it: " + text);
  }
  cudaEvent_t done = nullptr;
  ce = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
  if (ce == cudaSuccess) ce = cudaEventRecord(done, stream_);
  if (ce != cudaSuccess) {
    (void)cudaGetLastError();
    if (done != nullptr) (void)cudaEventDestroy(done);
    fail(d, 'e', "recording its completion event failed: " + cuda_error_text(ce));
  }
  COHORT_TRACE(kColl, "{} enqueued on GPU {}", d.describe(), device_);
  auto work = std::make_shared<NcclWork>(shared_from_this(), std::move(d), done, deadline);
  watch(work);
  return work;
}

void NcclComm::watch(const std::shared_ptr<NcclWork>& w) {
  std::lock_guard<std::mutex> g(watch_->mu);
  if (watch_->stop) return;
  watch_->works.push_back(w);
  if (watchdog_.joinable()) return;
  watchdog_ = std::thread([state = watch_, device = device_] {
    (void)cudaSetDevice(device);
    std::unique_lock<std::mutex> lk(state->mu);
    while (!state->stop) {
      state->cv.wait_for(lk, std::chrono::milliseconds(100), [&] { return state->stop; });
      if (state->stop) break;
      std::vector<std::shared_ptr<NcclWork>> live = state->works;
      lk.unlock();
      std::vector<const NcclWork*> finished;
      for (const auto& p : live)
        if (p->watch_once()) finished.push_back(p.get());
      lk.lock();
      std::erase_if(state->works, [&](const std::shared_ptr<NcclWork>& e) {
        return std::find(finished.begin(), finished.end(), e.get()) != finished.end();
      });
      // Dropping the last owner of a work can destroy the communicator too (its
      // destructor then detaches this thread, see stop_watchdog): not under the lock.
      lk.unlock();
      live.clear();
      lk.lock();
    }
  });
}

void NcclComm::stop_watchdog() noexcept {
  std::vector<std::shared_ptr<NcclWork>> dropped;
  {
    std::lock_guard<std::mutex> g(watch_->mu);
    watch_->stop = true;
    dropped.swap(watch_->works);
  }
  watch_->cv.notify_all();
  if (watchdog_.joinable()) {
    if (watchdog_.get_id() == std::this_thread::get_id())
      watchdog_.detach();  // the last owner of this communicator went away on the watchdog's own thread
    else
      watchdog_.join();
  }
  dropped.clear();
}

void NcclComm::check_health(const OpDesc& d) {
  ncclResult_t state = ncclSuccess, r = ncclSuccess;
  std::string text;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (aborted_ || comm_ == nullptr) return;  // broken (the work sees broken()) or shut down after draining
    r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess) state = r;
    if (state != ncclSuccess && state != ncclInProgress) text = nccl_error_text(state, comm_);
  }
  if (!text.empty()) fail(d, state == ncclRemoteError ? 'p' : 'e', "NCCL reports an asynchronous error: " + text);
  std::string f = poll_store_failure();
  if (!f.empty()) fail(d, 'p', "another rank failed first: " + f);
}

std::string NcclComm::context(const std::string& what) const {
  return fmt::format("rank {} (group {}, world rank {}, GPU {}, nccl): {} failed", setup_.rank, setup_.group_id,
                     setup_.world_ranks[setup_.rank], device_, what);
}

std::string NcclComm::record_first_failure(const std::string& why) {
  try {
    Bytes mine(why.begin(), why.end());
    Bytes cur = setup_.store->compare_set("failure", Bytes{}, mine);
    return std::string(cur.begin(), cur.end());
  } catch (const std::exception& e) {
    COHORT_WARN(kColl, "could not record the failure in the store: {}", e.what());
    return {};
  }
}

void NcclComm::fail(const OpDesc& d, char kind, const std::string& reason) {
  fail(fmt::format("{} [{} bytes]", d.describe(), d.bytes()), kind, reason);
}

void NcclComm::fail(const std::string& what, char kind, const std::string& reason) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (broken_) std::rethrow_exception(broken_);
  }
  const std::string ctx = context(what);
  const std::string why = fmt::format("rank {} failed in {}: {}", setup_.rank, what, reason);
  // As the native backend: record the group's first failure before aborting,
  // so that peers whose NCCL calls then fail can name the root cause.
  const std::string first = record_first_failure(why);
  std::string msg = fmt::format("{}: {}", ctx, reason);
  if (kind == 't')
    msg +=
        "; HINT: a peer is slow, hung or never called this collective; raise COHORT_TIMEOUT if the work is just long";
  if (!first.empty() && first != why) msg += "; first failure in the group: " + first;
  std::exception_ptr e = kind == 't'   ? std::make_exception_ptr(TimeoutError(msg))
                         : kind == 'p' ? std::make_exception_ptr(PeerError(msg, -1))
                                       : std::make_exception_ptr(Error(msg));
  COHORT_WARN(kColl, "{}", msg);
  std::lock_guard<std::mutex> g(mu_);
  if (broken_) std::rethrow_exception(broken_);  // another thread failed the group meanwhile
  broken_ = e;
  abort_locked();
  std::rethrow_exception(e);
}

void NcclComm::abort_locked() noexcept {
  if (aborted_) return;
  aborted_ = true;
  if (comm_ != nullptr) {
    // Frees the communicator and stops its kernels; this rank's stream then drains.
    ncclResult_t r = ncclCommAbort(comm_);
    if (r != ncclSuccess) COHORT_WARN(kColl, "ncclCommAbort: {}", ncclGetErrorString(r));
  }
  comm_ = nullptr;
}

std::exception_ptr NcclComm::broken() const {
  std::lock_guard<std::mutex> g(mu_);
  return broken_;
}

bool NcclComm::is_shut_down() const {
  std::lock_guard<std::mutex> g(mu_);
  return shut_;
}

void NcclComm::shutdown() noexcept {
  stop_watchdog();
  try {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (shut_) return;
      shut_ = true;
      if (comm_ == nullptr && stream_ == nullptr) return;  // never set up (a non-member of a split)
    }
    DeviceGuard guard(device_);
    const auto deadline = core::Deadline::after(setup_.timeout);
    bool clean = false;
    if (broken() == nullptr) {
      // Let enqueued operations finish, watching for NCCL errors, then finalize.
      bool failed = false;
      bool drained = poll_until(deadline, [&] {
        cudaError_t q = cudaStreamQuery(stream_);
        if (q == cudaSuccess) return true;
        if (q != cudaErrorNotReady) return failed = true;
        std::lock_guard<std::mutex> g(mu_);
        ncclResult_t st = ncclSuccess;
        if (comm_ == nullptr || ncclCommGetAsyncError(comm_, &st) != ncclSuccess ||
            (st != ncclSuccess && st != ncclInProgress))
          return failed = true;
        return false;
      });
      if (drained && !failed) {
        ncclResult_t r;
        {
          std::lock_guard<std::mutex> g(mu_);
          r = ncclCommFinalize(comm_);
        }
        std::string ignored;
        if (r == ncclInProgress) r = wait_ready(nullptr, true, deadline, &ignored);
        if (r == ncclSuccess) {
          std::lock_guard<std::mutex> g(mu_);
          r = ncclCommDestroy(comm_);
          comm_ = nullptr;
          clean = r == ncclSuccess;
        }
      }
      if (!clean) {
        std::string msg = fmt::format(
            "rank {} (group {}, GPU {}): the group was shut down before its operations finished "
            "cleanly (within {} ms); the communicator was aborted, so their results are undefined",
            setup_.rank, setup_.group_id, device_, setup_.timeout.count());
        COHORT_WARN(kColl, "{}", msg);
        std::lock_guard<std::mutex> g(mu_);
        if (!broken_) broken_ = std::make_exception_ptr(Error(msg));
      }
    }
    {
      std::lock_guard<std::mutex> g(mu_);
      if (comm_ != nullptr) abort_locked();
    }
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
    if (caller_ready_ != nullptr) (void)cudaEventDestroy(caller_ready_);
    stream_ = nullptr;
    caller_ready_ = nullptr;
  } catch (const std::exception& e) {
    COHORT_WARN(kColl, "NCCL shutdown: {}", e.what());
  }
}

}  // namespace cohort::group::nccl
