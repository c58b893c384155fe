// Rank-prefixed debug log, NCCL_DEBUG style.
//   COHORT_DEBUG=WARN|INFO|TRACE (default WARN), COHORT_DEBUG_SUBSYS=INIT,COLL,NET,...|ALL
// Lines go to stderr as "cohort[rank R] LEVEL SUBSYS: message". Thread-safe;
// a disabled level costs one relaxed load.
#pragma once

#include <cstdint>
#include <string>

#include <fmt/format.h>

namespace cohort::core {

enum class LogLevel : int { Warn = 1, Info = 2, Trace = 3 };

enum Subsys : uint32_t {
  kInit = 1u << 0,
  kColl = 1u << 1,
  kNet = 1u << 2,
  kTuning = 1u << 3,
  kDdp = 1u << 4,
  kLaunch = 1u << 5,
  kStore = 1u << 6,
  kAllSubsys = 0xffffffffu,
};

bool log_enabled(LogLevel level, Subsys subsys);
void log_write(LogLevel level, Subsys subsys, const std::string& msg);
// Where finished lines go instead of stderr (nullptr: stderr again). The
// launcher queues them for its console thread, so a stuck stderr reader never
// blocks it (launch/output.hpp, ConsoleWriter).
using LogWriter = void (*)(std::string line);
void set_log_writer(LogWriter writer);
// Sets the "rank R" in every later line of this process (-1: not known yet).
void set_log_rank(int rank);
int log_rank();

}  // namespace cohort::core

#define COHORT_LOG(level, subsys, ...)                                                              \
  do {                                                                                              \
    if (::cohort::core::log_enabled(::cohort::core::LogLevel::level, ::cohort::core::subsys))       \
      ::cohort::core::log_write(::cohort::core::LogLevel::level, ::cohort::core::subsys,            \
                                fmt::format(__VA_ARGS__));                                           \
  } while (0)

#define COHORT_WARN(subsys, ...) COHORT_LOG(Warn, subsys, __VA_ARGS__)
#define COHORT_INFO(subsys, ...) COHORT_LOG(Info, subsys, __VA_ARGS__)
#define COHORT_TRACE(subsys, ...) COHORT_LOG(Trace, subsys, __VA_ARGS__)
