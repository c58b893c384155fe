// DDP iteration spans and times (iteration_record.hpp).
#include "ddp/iteration_record.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "core/timeline.hpp"

namespace cohort::ddp {
namespace {

namespace tl = core::timeline;

std::mutex g_mu;
std::map<const ProcessGroup*, IterationTimes> g_last;  // by the reducer's group (ranks may be threads of one process)

bool happened(SteadyTime t) {
  return t.time_since_epoch().count() != 0;
}

}  // namespace

int64_t to_ns(SteadyTime t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

IterationTimes iteration_times(const IterationStats& st, int nranks) {
  IterationTimes it;
  it.iteration = st.iteration;
  it.nranks = nranks;
  it.first_mark_ns = to_ns(st.first_mark);
  it.wait_started_ns = to_ns(st.wait_started);
  it.finalized_ns = to_ns(st.finalized);
  it.comm_end_ns = it.wait_started_ns;
  std::vector<std::pair<int64_t, int64_t>> flight;
  for (const auto& b : st.buckets) {
    if (!happened(b.launched) || !happened(b.completed)) continue;
    it.bytes += b.bytes;
    if (b.bytes == 0) continue;
    flight.emplace_back(to_ns(b.launched), to_ns(b.completed));
    it.comm_end_ns = std::max(it.comm_end_ns, to_ns(b.completed));
  }
  it.exposed_ns = std::max<int64_t>(0, it.comm_end_ns - it.wait_started_ns);
  // Union of the in-flight intervals: buckets queue behind each other on one group.
  std::sort(flight.begin(), flight.end());
  int64_t end = INT64_MIN;
  for (auto [a, b] : flight) {
    if (a > end) {
      it.comm_ns += b - a;
      end = b;
    } else if (b > end) {
      it.comm_ns += b - end;
      end = b;
    }
  }
  return it;
}

void record_iteration(const IterationStats& st, const ProcessGroup& group) {
  const int rank = group.rank();
  IterationTimes it = iteration_times(st, group.size());
  {
    std::lock_guard<std::mutex> lk(g_mu);
    g_last[&group] = it;
  }
  if (!tl::enabled()) return;
  const std::string iter = fmt::format(R"({{"iteration":{},"rank":{}}})", st.iteration, rank);
  if (happened(st.first_mark))
    tl::span("ddp", "backward", "ddp", it.first_mark_ns, it.wait_started_ns,
             fmt::format(R"({{"iteration":{},"gradients":{}}})", st.iteration, st.marks));
  tl::span("ddp", "comm wait", "ddp", it.wait_started_ns, it.wait_started_ns + it.exposed_ns, iter);
  for (const auto& b : st.buckets) {
    if (happened(b.ready))
      tl::instant("ddp buckets", fmt::format("bucket {} ready", b.index), "ddp", to_ns(b.ready),
                  fmt::format(R"({{"bucket":{},"iteration":{}}})", b.index, st.iteration));
    if (happened(b.launched) && happened(b.completed) && b.bytes > 0)
      tl::async_span("ddp buckets", fmt::format("bucket {} allreduce", b.index), "bucket",
                     st.iteration * 4096 + b.index, to_ns(b.launched), to_ns(b.completed),
                     fmt::format(R"({{"bucket":{},"iteration":{},"bytes":{},"params":{},"launched_in_finalize":{}}})",
                                 b.index, st.iteration, b.bytes, b.params, b.launched_in_finalize ? "true" : "false"));
  }
}

std::optional<IterationTimes> last_iteration(const ProcessGroup& group) {
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_last.find(&group);
  if (it != g_last.end()) return it->second;
  if (g_last.size() == 1) return g_last.begin()->second;
  return std::nullopt;
}

}  // namespace cohort::ddp
