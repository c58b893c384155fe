// `cohort trace merge` and `cohort trace summary`: join the per-rank timelines
// (COHORT_TIMELINE, src/core/timeline.hpp) and read the step breakdown out of them.
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace cohort::tools::trace {

// Reads one rank's file; a file cut short (no closing "]", the process died)
// is repaired, and *cut_short (when given) says so. Throws Error naming the
// file when it is not a timeline.
nlohmann::json read_rank_file(const std::string& path, bool* cut_short = nullptr);

// Joins DIR/rank*.json: one process (pid) per rank, every timestamp shifted by
// the rank's clock offset to rank 0 and the whole job moved to start at 0.
// otherData.cohort.ranks[i].cut_short is true for a file that was repaired.
// Throws Error when DIR has no rank files.
nlohmann::json merge_dir(const std::string& dir);

struct OpStat {
  int count = 0;
  double ms = 0;  // time running
  double bytes = 0;
};

// Per rank, summed over its steps ("step" spans of the training loop; when a
// program marks none, the whole trace counts as one step).
struct RankSummary {
  int rank = 0;
  int steps = 0;
  double step_ms = 0;      // wall time of the steps
  double data_ms = 0;      // "data" spans: waiting for the next batch
  double exposed_ms = 0;   // "comm wait" spans: waiting for gradient allreduces after backward
  double compute_ms = 0;   // the rest: step - data - exposed
  double comm_ms = 0;      // in flight inside the steps: DDP buckets from launch to completion when the trace
                           // has them (as StepMetrics counts), else the collectives running
  double overlap_pct = 0;  // share of comm_ms hidden behind compute: 100 * (1 - exposed / comm)
  bool marked_steps = false;
  std::map<std::string, OpStat> ops;  // by collective name, over the whole trace
};

std::vector<RankSummary> summarize(const nlohmann::json& merged);

// The table `cohort trace summary` prints.
std::string format_summary(const std::vector<RankSummary>& s);

// The per-rank stacked bars (mean per step: compute, exposed communication, data wait), as SVG.
std::string summary_svg(const std::vector<RankSummary>& s, const std::string& title);

}  // namespace cohort::tools::trace
