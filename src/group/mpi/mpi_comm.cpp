// CommState and the Work handles of the MPI backend (mpi_comm.hpp).
#include "group/mpi/mpi_comm.hpp"

#include <fmt/format.h>
#include <sched.h>

#include "core/log.hpp"
#include "group/mpi/mpi_progress.hpp"

namespace cohort::group::mpi {

MpiWork::MpiWork(std::shared_ptr<CommState> comm, const OpDesc& d, Millis timeout)
    : comm_(std::move(comm)),
      desc_(d),
      deadline_(core::Deadline::after(timeout)),
      timeout_(timeout),
      p2p_(d.coll == collectives::Coll::Send || d.coll == collectives::Coll::Recv ||
           d.coll == collectives::Coll::P2PBatch) {}

bool MpiWork::is_completed() const {
  if (done_.load(std::memory_order_acquire)) return true;
  // The progress thread's blocking call holds MPI (and progresses this request meanwhile): ask again later.
  if (Progress::get().busy()) return false;
  std::lock_guard<MpiLock> g(mpi_lock());
  comm_->test_pending();
  return done_.load(std::memory_order_acquire);
}

void MpiWork::wait(Millis timeout) {
  if (!done_.load(std::memory_order_acquire)) {
    // The operations queued before run first: blocking in MPI_Waitall here
    // would keep the progress thread out of MPI, and a peer may answer this
    // request only after its own copy of a queued collective.
    Progress::get().wait_idle();
    std::unique_lock<MpiLock> lk(mpi_lock());
    // A wait shorter than the operation's own deadline polls, so that it can
    // give up; otherwise it blocks in MPI_Waitall (MPI progresses fastest
    // there) and the watchdog enforces the operation's deadline.
    const bool short_wait = timeout.count() > 0 && timeout < timeout_;
    core::Deadline until = core::Deadline::after(timeout);
    if (!comm_->complete_through(this, short_wait ? &until : nullptr))
      throw TimeoutError(
          fmt::format("rank {}: Work::wait timed out after {} ms on {}; the operation is still running "
                      "(MPI cannot cancel it: wait again, or let COHORT_TIMEOUT end the job)",
                      comm_->rank, timeout.count(), desc_.describe()));
  }
  if (err_) std::rethrow_exception(err_);
}

std::exception_ptr MpiWork::error() const {
  return done_.load(std::memory_order_acquire) ? err_ : nullptr;
}

void MpiWork::complete(int rc, const char* call, std::vector<MPI_Status>& st) {
  try {
    if (rc != MPI_SUCCESS) {
      // MPI_ERR_IN_STATUS: the first request's own error says more.
      int code = rc;
      if (rc == MPI_ERR_IN_STATUS)
        for (auto& s : st)
          if (s.MPI_ERROR != MPI_SUCCESS && s.MPI_ERROR != MPI_ERR_PENDING) {
            code = s.MPI_ERROR;
            break;
          }
      throw_mpi_error(code, call, desc_, comm_->rank);
    }
    for (size_t i = 0; i < recv_counts.size(); ++i) {
      if (recv_counts[i] < 0) continue;
      int got = 0;
      MPI_Get_count(&st[i], MPI_BYTE, &got);
      const int64_t want_bytes = recv_counts[i];
      if (got != want_bytes)
        throw InvalidArgument(
            fmt::format("rank {}: {}: received {} bytes from rank {} where {} were expected; the "
                        "receiver's count must equal the sender's",
                        comm_->rank, desc_.describe(), got, st[i].MPI_SOURCE, want_bytes));
    }
    if (finish) finish();
  } catch (...) {
    err_ = std::current_exception();
  }
  scratch.clear();
  scratch.shrink_to_fit();
  done_.store(true, std::memory_order_release);
}

bool MpiWork::test_once() {
  int flag = 0;
  std::vector<MPI_Status> st(reqs.size());
  int rc = MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &flag, st.data());
  if (rc == MPI_SUCCESS && !flag) return false;
  complete(rc, "MPI_Testall", st);
  return true;
}

bool MpiWork::drive(const core::Deadline* poll_until) {
  if (done_.load(std::memory_order_relaxed)) return true;
  if (poll_until == nullptr) {
    std::vector<MPI_Status> st(reqs.size());
    const auto left = std::chrono::duration_cast<Millis>(deadline_.at - core::Clock::now());
    int rc;
    {
      Armed a(desc_, comm_->rank, left.count() > 0 ? left : Millis(1), "MPI_Waitall");
      rc = MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), st.data());
    }
    complete(rc, "MPI_Waitall", st);
    return true;
  }
  for (;;) {
    if (test_once()) return true;
    if (poll_until->passed()) return false;
    sched_yield();
  }
}

CommState::CommState(MPI_Comm c, Millis t, std::vector<int> wr)
    : comm(c), timeout(t), world_ranks(std::move(wr)), done_(new DoneWork) {  // never deleted: see done()
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
}

CommState::~CommState() {
  shutdown();
}

void CommState::drain(bool collectives_only) {
  for (auto it = pending.begin(); it != pending.end();) {
    if (collectives_only && (*it)->p2p()) {
      ++it;
      continue;
    }
    auto w = *it;  // keeps it alive while driven
    w->drive(nullptr);
    it = pending.erase(it);
  }
}

bool CommState::complete_through(const MpiWork* target, const core::Deadline* poll_until) {
  for (auto it = pending.begin(); it != pending.end() && !target->done_.load(std::memory_order_relaxed);) {
    const bool is_target = it->get() == target;
    if (!is_target && (target->p2p() || (*it)->p2p())) {  // point-to-point: neither waits for nor holds up others
      ++it;
      continue;
    }
    auto w = *it;
    if (!w->drive(poll_until)) return false;
    it = pending.erase(it);
  }
  return true;
}

void CommState::test_pending() {
  bool in_order = true;  // no collective before this one is still running
  for (auto it = pending.begin(); it != pending.end();) {
    auto w = *it;
    if ((w->p2p() || in_order) && w->test_once()) {
      it = pending.erase(it);
      continue;
    }
    if (!w->p2p()) in_order = false;
    ++it;
  }
}

void CommState::shutdown() {
  if (shut_down.exchange(true)) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;  // MPI_Finalize (at exit) freed every communicator already
  try {
    drain();
  } catch (const std::exception& e) {
    COHORT_WARN(kColl, "mpi backend: shutdown: {}", e.what());
  }
  if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
}

}  // namespace cohort::group::mpi
