#include "transport/engine.hpp"

#include <poll.h>
#include <sched.h>

#include <algorithm>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cohort/error.hpp"
#include "core/env.hpp"

namespace cohort::transport {
namespace {

const core::Knob kSpinUs{"COHORT_SPIN_US", "30",
                         "microseconds a waiting rank busy-polls before it starts yielding the CPU; unset, 30, or 0 "
                         "where the ranks on this host outnumber its CPUs (COHORT_HOST_CPUS)",
                         core::KnobKind::Int};
const core::Knob kYieldUs{"COHORT_YIELD_US", "300",
                          "microseconds a waiting rank calls sched_yield() before it sleeps on a futex / poll()",
                          core::KnobKind::Int};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

constexpr int kLivenessCheckMs = 100;

}  // namespace

bool cpus_oversubscribed(int host_ranks, int host_cpus) {
  return host_ranks > 0 && host_cpus > 0 && host_ranks > host_cpus;
}

int spin_us_for(int host_ranks, int host_cpus) {
  if (kSpinUs.is_set()) return static_cast<int>(kSpinUs.integer());
  return cpus_oversubscribed(host_ranks, host_cpus) ? 0 : static_cast<int>(kSpinUs.integer());
}

Engine::Engine(Waiter* shm_waiter, int spin_us)
    : shm_waiter_(shm_waiter),
      spin_us_(std::max(0, spin_us)),
      yield_us_(static_cast<int>(kYieldUs.integer())) {}

namespace {
// True if an op before ops[i] on the same connection is still incomplete. A
// connection carries one message per direction at a time (the TCP stream and
// the shm FIFO would interleave two), so a batch with two messages to or from
// the same peer moves them in the order given.
template <class Op>
bool behind_same_peer(std::span<Op> ops, size_t i) {
  for (size_t j = 0; j < i; ++j)
    if (!ops[j].complete && ops[j].conn == ops[i].conn) return true;
  return false;
}
}  // namespace

bool Engine::progress_all(std::span<SendOp> sends, std::span<RecvOp> recvs, bool& all_done) {
  bool moved = false;
  all_done = true;
  for (size_t i = 0; i < sends.size(); ++i) {
    SendOp& s = sends[i];
    if (s.complete) continue;
    if (!behind_same_peer(sends, i)) moved |= s.conn->progress_send(s);
    all_done &= s.complete;
  }
  for (size_t i = 0; i < recvs.size(); ++i) {
    RecvOp& r = recvs[i];
    if (r.complete) continue;
    if (!behind_same_peer(recvs, i)) moved |= r.conn->progress_recv(r);
    all_done &= r.complete;
  }
  return moved;
}

void Engine::run(std::span<SendOp> sends, std::span<RecvOp> recvs, core::Deadline deadline) {
  bool done = false;
  progress_all(sends, recvs, done);
  if (done) return;

  using core::Clock;
  auto idle_since = Clock::now();
  auto last_check = idle_since;
  auto wait_start = idle_since;
  unsigned iter = 0;
  for (;;) {
    if (progress_all(sends, recvs, done)) {
      if (done) return;
      iter = 0;
      idle_since = Clock::now();
      continue;
    }
    if (done) return;
    ++iter;
    if ((iter & 63) != 0 && iter < 4096) {
      cpu_relax();
      continue;
    }
    auto now = Clock::now();
    auto idle_us = std::chrono::duration_cast<std::chrono::microseconds>(now - idle_since).count();
    if (deadline.passed(now)) throw_timeout(sends, recvs, core::seconds_since(wait_start));
    if (now - last_check > std::chrono::milliseconds(kLivenessCheckMs)) {
      last_check = now;
      for (auto& s : sends)
        if (!s.complete) s.conn->check_alive();
      for (auto& r : recvs)
        if (!r.complete) r.conn->check_alive();
    }
    if (idle_us < spin_us_) {
      cpu_relax();
    } else if (idle_us < spin_us_ + yield_us_) {
      sched_yield();
    } else {
      sleep_once(sends, recvs, std::min(kLivenessCheckMs, deadline.remaining_ms(kLivenessCheckMs)));
    }
  }
}

void Engine::sleep_once(std::span<SendOp> sends, std::span<RecvOp> recvs, int timeout_ms) {
  std::vector<pollfd> fds;
  bool any_shm = false;
  for (auto& s : sends) {
    if (s.complete) continue;
    if (s.conn->kind() == Kind::Shm) any_shm = true;
    else s.conn->poll_fds(fds, POLLOUT);
  }
  for (auto& r : recvs) {
    if (r.complete) continue;
    if (r.conn->kind() == Kind::Shm) any_shm = true;
    else r.conn->poll_fds(fds, POLLIN);
  }
  if (any_shm && shm_waiter_ != nullptr) {
    uint32_t token = shm_waiter_->prepare_sleep();
    bool done = false;
    // Re-check after announcing the sleep: a peer that published before it saw
    // our flag did not ring, so its data must be visible now.
    if (progress_all(sends, recvs, done) || done) {
      shm_waiter_->finish_sleep();
      return;
    }
    if (fds.empty()) {
      shm_waiter_->sleep(token, timeout_ms * 1000);
    } else {
      ::poll(fds.data(), fds.size(), 1);  // mixed: poll the sockets in short slices
    }
    shm_waiter_->finish_sleep();
    return;
  }
  if (!fds.empty()) ::poll(fds.data(), fds.size(), timeout_ms);
}

void Engine::throw_timeout(std::span<SendOp> sends, std::span<RecvOp> recvs, double waited_s) {
  std::string what;
  for (auto& r : recvs)
    if (!r.complete)
      what += fmt::format("{}receiving {} bytes from {} (got {})", what.empty() ? "" : "; ", r.bytes, r.conn->describe(), r.done);
  for (auto& s : sends)
    if (!s.complete)
      what += fmt::format("{}sending {} bytes to {} (sent {})", what.empty() ? "" : "; ", s.bytes, s.conn->describe(), s.done);
  throw TimeoutError(fmt::format("timed out after {:.1f} s {}", waited_s, what));
}

}  // namespace cohort::transport
