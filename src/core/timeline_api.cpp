// The public side of the timeline (include/cohort/timeline.hpp).
#include "cohort/timeline.hpp"
#include "core/timeline.hpp"

namespace cohort::timeline {

bool enabled() {
  return core::timeline::enabled();
}

Span::Span(const char* name, const char* track)
    : name_(name), track_(track), start_ns_(core::timeline::enabled() ? core::timeline::now_ns() : 0) {}

Span::~Span() {
  if (start_ns_ != 0) core::timeline::span(track_, name_, "phase", start_ns_, core::timeline::now_ns());
}

}  // namespace cohort::timeline
