// Deadlines. Every wait in cohort has one (docs/design.md habit 9).
#pragma once

#include <chrono>
#include <cstdint>
#include <type_traits>

namespace cohort::core {

using Clock = std::chrono::steady_clock;

struct Deadline {
  Clock::time_point at;

  // d from now. Saturating: a timeout too long for the clock (milliseconds::max()
  // as "forever", a knob of 1e300 s) is a deadline that never passes, not an
  // overflow into the past.
  template <class Rep, class Period>
  static Deadline after(std::chrono::duration<Rep, Period> d) {
    const auto now = Clock::now();
    const std::chrono::duration<double> room = Clock::time_point::max() - now;
    if (!(std::chrono::duration<double>(d) < room)) return never();
    return Deadline{now + std::chrono::duration_cast<Clock::duration>(d)};
  }
  static Deadline never() { return Deadline{Clock::time_point::max()}; }
  bool passed() const { return Clock::now() >= at; }
  bool passed(Clock::time_point now) const { return now >= at; }
  // Remaining time in milliseconds, clamped to [0, cap].
  int remaining_ms(int cap = 1 << 30) const {
    auto now = Clock::now();
    if (now >= at) return 0;
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(at - now).count();
    return ms > cap ? cap : static_cast<int>(ms) + 1;
  }
};

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace cohort::core
