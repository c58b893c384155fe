// StopSignal (include/cohort/stop_signal.hpp): a flag set by a signal
// handler, and a MAX allreduce of it at the step boundary.
#include "cohort/stop_signal.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "cohort/error.hpp"

namespace cohort {
namespace {

std::atomic<int> g_received{0};  // lock-free: written from the handler
std::atomic<bool> g_alive{false};

// The default action: the signal stays blocked while its handler runs, so
// the raised one is delivered, with SIG_DFL, when the handler returns.
void end_process(int sig) {
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(sig, &dfl, nullptr);
  raise(sig);
}

extern "C" void on_stop_signal(int sig, siginfo_t* info, void*) {
  const bool after_failure = info != nullptr && info->si_code == SI_QUEUE && info->si_value.sival_int == kStopAfterFailure;
  if (after_failure) return end_process(sig);
  int none = 0;
  g_received.compare_exchange_strong(none, sig);
}

constexpr int kAllowed[] = {SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2, SIGQUIT};

}  // namespace

StopSignal::StopSignal(std::vector<int> signals) : signals_(std::move(signals)) {
  static_assert(std::atomic<int>::is_always_lock_free, "the handler needs a lock-free flag");
  if (signals_.empty()) throw InvalidArgument("cohort::StopSignal: no signals given; HINT: the default is {SIGTERM}");
  for (size_t i = 0; i < signals_.size(); ++i) {
    const int sig = signals_[i];
    if (std::find(std::begin(kAllowed), std::end(kAllowed), sig) == std::end(kAllowed))
      throw InvalidArgument(fmt::format(
          "cohort::StopSignal: signal {} ({}) cannot ask for a stop; HINT: use SIGTERM, SIGINT, SIGHUP, SIGUSR1, "
          "SIGUSR2 or SIGQUIT (SIGKILL and SIGSTOP cannot be caught)",
          sig, sig > 0 && sig < NSIG ? strsignal(sig) : "no such signal"));
    if (std::find(signals_.begin(), signals_.begin() + static_cast<std::ptrdiff_t>(i), sig) !=
        signals_.begin() + static_cast<std::ptrdiff_t>(i))
      throw InvalidArgument(fmt::format("cohort::StopSignal: signal {} ({}) is named twice; HINT: name each once",
                                        sig, strsignal(sig)));
  }
  if (g_alive.exchange(true))
    throw InvalidArgument("cohort::StopSignal: another StopSignal is alive in this process; HINT: keep one for the "
                          "whole training loop");
  g_received.store(0);
  struct sigaction sa {};
  sa.sa_sigaction = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_SIGINFO | SA_RESTART;  // a read or a wait in progress goes on
  for (int sig : signals_) {
    struct sigaction old {};
    sigaction(sig, &sa, &old);
    previous_.push_back(old);
  }
}

StopSignal::~StopSignal() {
  for (size_t i = 0; i < signals_.size(); ++i) sigaction(signals_[i], &previous_[i], nullptr);
  g_alive.store(false);
}

int StopSignal::received() const { return g_received.load(); }

int StopSignal::agreed(ProcessGroup& group) {
  int32_t v = g_received.load();
  if (group.size() == 1) return v;
  ProcessGroup& host = group.host_group();
  host.allreduce(Buffer{&v, 1, DType::I32}, AllreduceOptions{.op = ReduceOp::Max})->wait();
  return v;
}

}  // namespace cohort
