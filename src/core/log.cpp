#include "core/log.hpp"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <sstream>

#include "core/env.hpp"

namespace cohort::core {
namespace {

const Knob kDebug{"COHORT_DEBUG", "WARN", "log level: WARN (quiet in normal runs), INFO (init, transports, tuning), TRACE (every collective)"};
const Knob kDebugSubsys{"COHORT_DEBUG_SUBSYS", "ALL",
                        "comma list of subsystems to log: INIT,COLL,NET,TUNING,DDP,LAUNCH,STORE or ALL; ^X excludes X"};

struct Config {
  int level;
  uint32_t mask;
};

uint32_t subsys_bit(const std::string& s) {
  if (s == "INIT") return kInit;
  if (s == "COLL") return kColl;
  if (s == "NET") return kNet;
  if (s == "TUNING") return kTuning;
  if (s == "DDP") return kDdp;
  if (s == "LAUNCH") return kLaunch;
  if (s == "STORE") return kStore;
  if (s == "ALL") return kAllSubsys;
  return 0;
}

Config load() {
  Config c{1, kAllSubsys};
  std::string lv = kDebug.str();
  for (auto& ch : lv) ch = static_cast<char>(toupper(ch));
  if (lv == "INFO") c.level = 2;
  else if (lv == "TRACE") c.level = 3;
  else if (lv == "NONE" || lv == "OFF") c.level = 0;
  else if (lv != "WARN")  // said once per process, on stderr: the logger is what is being set up
    std::fprintf(stderr, "cohort: warning: COHORT_DEBUG=%s is not a log level (WARN, INFO, TRACE or NONE); logging at "
                         "WARN\n", kDebug.str().c_str());
  std::string list = kDebugSubsys.str();
  bool any_positive = false;
  uint32_t plus = 0, minus = 0;
  std::stringstream ss(list);
  std::string tok;
  while (std::getline(ss, tok, ',')) {
    for (auto& ch : tok) ch = static_cast<char>(toupper(ch));
    if (tok.empty()) continue;
    const std::string name = tok[0] == '^' ? tok.substr(1) : tok;
    if (subsys_bit(name) == 0)
      std::fprintf(stderr, "cohort: warning: COHORT_DEBUG_SUBSYS: '%s' is not a subsystem (INIT, COLL, NET, TUNING, "
                           "DDP, LAUNCH, STORE or ALL; ^X excludes X); ignored\n", name.c_str());
    if (tok[0] == '^') minus |= subsys_bit(name);
    else { plus |= subsys_bit(name); any_positive = true; }
  }
  c.mask = (any_positive ? plus : kAllSubsys) & ~minus;
  return c;
}

const Config& config() {
  static const Config c = load();
  return c;
}

std::atomic<int> g_rank{-1};
std::mutex g_write_mu;
std::atomic<LogWriter> g_writer{nullptr};

const char* level_name(LogLevel l) {
  switch (l) {
    case LogLevel::Warn: return "WARN";
    case LogLevel::Info: return "INFO";
    case LogLevel::Trace: return "TRACE";
  }
  return "?";
}

const char* subsys_name(Subsys s) {
  switch (s) {
    case kInit: return "INIT";
    case kColl: return "COLL";
    case kNet: return "NET";
    case kTuning: return "TUNING";
    case kDdp: return "DDP";
    case kLaunch: return "LAUNCH";
    case kStore: return "STORE";
    default: return "ALL";
  }
}

}  // namespace

bool log_enabled(LogLevel level, Subsys subsys) {
  const Config& c = config();
  return static_cast<int>(level) <= c.level && (c.mask & subsys) != 0;
}

void log_write(LogLevel level, Subsys subsys, const std::string& msg) {
  int r = g_rank.load(std::memory_order_relaxed);
  std::string line = r >= 0 ? fmt::format("cohort[rank {}] {} {}: {}\n", r, level_name(level), subsys_name(subsys), msg)
                            : fmt::format("cohort[pid {}] {} {}: {}\n", getpid(), level_name(level), subsys_name(subsys), msg);
  std::lock_guard<std::mutex> g(g_write_mu);
  if (LogWriter w = g_writer.load()) {
    w(std::move(line));
    return;
  }
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

void set_log_writer(LogWriter writer) { g_writer.store(writer); }

void set_log_rank(int rank) { g_rank.store(rank, std::memory_order_relaxed); }
int log_rank() { return g_rank.load(std::memory_order_relaxed); }

}  // namespace cohort::core
