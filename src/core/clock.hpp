// Deadlines. Every wait in cohort has one (DESIGN.md habit 9).
#pragma once

#include <chrono>
#include <cstdint>

namespace cohort::core {

using Clock = std::chrono::steady_clock;

struct Deadline {
  Clock::time_point at;

  static Deadline after(std::chrono::nanoseconds d) { return Deadline{Clock::now() + d}; }
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
