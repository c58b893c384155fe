#include "core/env.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <mutex>

#include <fmt/format.h>

#include "cohort/error.hpp"

namespace cohort::core {
namespace {

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::vector<const Knob*>& registry() {
  static std::vector<const Knob*> r;
  return r;
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

}  // namespace

Knob::Knob(const char* name, const char* default_value, const char* help, KnobKind kind)
    : name_(name), default_(default_value), help_(help), kind_(kind) {
  std::lock_guard<std::mutex> g(registry_mutex());
  registry().push_back(this);
}

bool Knob::is_set() const {
  const char* v = std::getenv(name_);
  return v != nullptr && *v != '\0';
}

std::string Knob::str() const {
  const char* v = std::getenv(name_);
  return (v != nullptr && *v != '\0') ? std::string(v) : std::string(default_);
}

int64_t Knob::integer() const {
  std::string v = str();
  char* end = nullptr;
  long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0')
    throw InvalidArgument(fmt::format("{}={} is not an integer; set it to a whole number (default {})", name_, v, default_));
  return x;
}

uint64_t Knob::bytes() const {
  std::string v = str();
  auto b = parse_bytes(v);
  if (!b) throw InvalidArgument(fmt::format("{}={} is not a byte size; use e.g. 4096, 64K, 1M or 2G (default {})", name_, v, default_));
  return *b;
}

bool Knob::boolean() const {
  std::string v = lower(str());
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off" || v.empty()) return false;
  throw InvalidArgument(fmt::format("{}={} is not a boolean; use 1/0, true/false, yes/no or on/off", name_, v));
}

double Knob::seconds() const {
  std::string v = str();
  auto s = parse_seconds(v);
  if (!s) throw InvalidArgument(fmt::format("{}={} is not a duration; use e.g. 30, 30s, 500ms or 5m (default {})", name_, v, default_));
  return *s;
}

std::chrono::milliseconds Knob::millis() const {
  const double ms = std::ceil(seconds() * 1000.0);
  if (ms >= static_cast<double>(kLongestWait.count())) return kLongestWait;
  return std::chrono::milliseconds(static_cast<int64_t>(ms));
}

std::string Knob::problem() const {
  if (!is_set()) return "";
  try {
    switch (kind_) {
      case KnobKind::String: return "";
      case KnobKind::Int: (void)integer(); return "";
      case KnobKind::Bytes: (void)bytes(); return "";
      case KnobKind::Bool: (void)boolean(); return "";
      case KnobKind::Seconds: (void)seconds(); return "";
    }
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

std::vector<std::string> knob_problems() {
  std::vector<std::string> out;
  for (const Knob* k : all_knobs())
    if (std::string p = k->problem(); !p.empty()) out.push_back(std::move(p));
  return out;
}

std::vector<const Knob*> all_knobs() {
  std::lock_guard<std::mutex> g(registry_mutex());
  auto r = registry();
  std::sort(r.begin(), r.end(), [](const Knob* a, const Knob* b) { return std::string_view(a->name()) < b->name(); });
  r.erase(std::unique(r.begin(), r.end(), [](const Knob* a, const Knob* b) { return std::string_view(a->name()) == b->name(); }), r.end());
  return r;
}

std::optional<uint64_t> parse_bytes(const std::string& s) {
  if (s.empty()) return std::nullopt;
  char* end = nullptr;
  double x = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || !(x >= 0) || !std::isfinite(x)) return std::nullopt;  // NaN, inf, negative
  std::string unit = lower(std::string(end));
  if (!unit.empty() && unit.back() == 'b') unit.pop_back();
  if (!unit.empty() && unit.back() == 'i') unit.pop_back();
  double mult = 1;
  if (unit.empty()) mult = 1;
  else if (unit == "k") mult = 1024.0;
  else if (unit == "m") mult = 1024.0 * 1024;
  else if (unit == "g") mult = 1024.0 * 1024 * 1024;
  else return std::nullopt;
  if (x * mult >= 18446744073709551616.0) return std::nullopt;  // 2^64: no uint64_t holds it
  return static_cast<uint64_t>(x * mult);
}

std::optional<double> parse_seconds(const std::string& s) {
  if (s.empty()) return std::nullopt;
  char* end = nullptr;
  double x = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || !std::isfinite(x) || x < 0) return std::nullopt;  // also "inf" and "nan"
  std::string unit = lower(std::string(end));
  if (unit.empty() || unit == "s") return x;
  if (unit == "ms") return x / 1000.0;
  if (unit == "us") return x / 1e6;
  if (unit == "m" || unit == "min") return x * 60.0;
  if (unit == "h") return x * 3600.0;
  return std::nullopt;
}

}  // namespace cohort::core
