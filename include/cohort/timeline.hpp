// cohort/timeline.hpp: mark your own phases on the COHORT_TIMELINE trace.
//
//   { cohort::timeline::Span s("forward"); auto out = model(x); }
//
// Spans go to the "train" track of this rank's trace (docs/observability.md).
// When COHORT_TIMELINE is unset a Span costs one relaxed load.
#pragma once

#include <cstdint>
#include <string>
#include "cohort/export.hpp"

namespace cohort::timeline {

// True when COHORT_TIMELINE is set for this process.
COHORT_API bool enabled();

class COHORT_API Span {
 public:
  // `name` must outlive the span (a string literal).
  explicit Span(const char* name, const char* track = "train");
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  const char* name_;
  const char* track_;
  int64_t start_ns_;
};

}  // namespace cohort::timeline
