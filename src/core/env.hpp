// Environment knobs. Each knob is declared once, beside the code it tunes:
//
//   static const core::Knob kSlotBytes{"COHORT_SHM_SLOT_BYTES", "256K", "bytes per ...", core::KnobKind::Bytes};
//
// and registers itself, so that `cohort env` and docs/env.md list every knob.
// Values are read from the environment on each call (cheap; call sites that are
// hot read once and cache).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace cohort::core {

enum class KnobKind { String, Int, Bytes, Bool, Seconds };

class Knob {
 public:
  Knob(const char* name, const char* default_value, const char* help, KnobKind kind = KnobKind::String);
  const char* name() const { return name_; }
  const char* default_value() const { return default_; }
  const char* help() const { return help_; }
  KnobKind kind() const { return kind_; }

  bool is_set() const;
  std::string str() const;      // the value, or the default when unset
  int64_t integer() const;      // InvalidArgument names the knob when the value is not a number
  uint64_t bytes() const;       // accepts 4096, 64K, 1M, 2G (binary units)
  bool boolean() const;         // 1/0, true/false, yes/no, on/off
  double seconds() const;       // accepts 30, 30s, 500ms, 5m
  // The duration in whole milliseconds: a positive value below 1 ms counts as
  // 1 ms (not 0), and anything longer than kLongestWait is cut to it.
  std::chrono::milliseconds millis() const;
  // What is wrong with the value set for a typed knob (the message its
  // accessor would throw), or "" when it parses or is a plain string.
  std::string problem() const;

 private:
  const char* name_;
  const char* default_;
  const char* help_;
  KnobKind kind_;
};

// The longest timeout cohort keeps (about 31.7 years): longer ones, "forever"
// in effect, are cut to it so that now + timeout stays within the clock.
inline constexpr std::chrono::milliseconds kLongestWait{1'000'000'000'000LL};

// Every knob registered so far (all of libcohort's, since it is a shared library).
std::vector<const Knob*> all_knobs();

// Every set knob whose value does not parse (Knob::problem), one message
// each, in name order: `cohort run` refuses to start with any, since a knob
// is read only where it applies (COHORT_RDZV_TIMEOUT only with several
// nodes) and a bad value would otherwise pass unnoticed or fail late.
std::vector<std::string> knob_problems();

// Parsers shared with the CLI (bench sizes, timeouts). nullopt on bad input.
std::optional<uint64_t> parse_bytes(const std::string& s);
std::optional<double> parse_seconds(const std::string& s);

}  // namespace cohort::core
