// cohort/metrics.hpp: where a training step spends its time.
//
//   cohort::StepMetrics metrics(*pg);
//   for (;;) {
//     metrics.begin_step();                  // before fetching the batch
//     auto batch = loader.next();
//     if (!batch) { metrics.cancel_step(); break; }
//     metrics.data_ready();                  // the batch is in hand
//     ... forward, backward (DDP), optimizer step ...
//     metrics.end_step();
//   }
//   std::puts(metrics.report().c_str());     // the end-of-run summary
//
// Each step is split into data wait (begin_step -> data_ready), exposed
// communication (DDP's finalize() waiting for gradient allreduces after
// backward ended) and compute (the rest). The overlap is the share of the
// gradient communication that ran while backward was still computing.
// Knobs: COHORT_METRICS=FILE appends one JSON line per COHORT_METRICS_EVERY
// steps and one for the run ("kind":"summary") to FILE; COHORT_METRICS_EVERY=N
// also logs the last N steps at INFO (COHORT_DEBUG=INFO, subsystem DDP).
// With COHORT_TIMELINE the steps appear as "step" and "data" spans on the
// "train" track. Not thread-safe: call from the training loop's thread.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cohort/process_group.hpp"
#include "cohort/export.hpp"

namespace cohort {

struct COHORT_API InterfaceBytes {
  std::string name;  // "eth0", "lo"
  uint64_t rx = 0, tx = 0;
};

struct COHORT_API StepSummary {
  int rank = 0;
  int64_t steps = 0;
  // Means per step, in milliseconds.
  double step_ms = 0, compute_ms = 0, exposed_comm_ms = 0, data_wait_ms = 0;
  double comm_ms = 0;               // gradient communication in flight per step (hidden or not)
  double overlap_pct = 0;           // 100 * (1 - exposed / comm): communication hidden behind backward
  double grad_bytes = 0;            // gradient bytes allreduced per step
  double busbw_gbps = 0;            // gradient allreduce bus bandwidth (GB/s) over the time in flight
  double coll_sent_bytes = 0;       // bytes this rank sent for them over the run (ring: 2 (n-1)/n of each bucket)
  std::vector<InterfaceBytes> net;  // /proc/net/dev over the run, interfaces that moved bytes
};

class COHORT_API StepMetrics {
 public:
  explicit StepMetrics(ProcessGroup& group);
  ~StepMetrics();  // finish() if not yet called
  StepMetrics(const StepMetrics&) = delete;
  StepMetrics& operator=(const StepMetrics&) = delete;

  void begin_step();
  void data_ready();
  void end_step();
  void cancel_step();  // the open step does not count (the loader ran out)

  StepSummary summary() const;
  // The summary as text lines for people.
  std::string report() const;
  // Writes the summary line to COHORT_METRICS and logs it at INFO. Once.
  void finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cohort
