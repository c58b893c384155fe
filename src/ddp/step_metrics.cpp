// StepMetrics (include/cohort/metrics.hpp): the step breakdown, its JSON lines and its log.
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

#include "cohort/error.hpp"
#include "cohort/metrics.hpp"
#include "core/env.hpp"
#include "core/fd.hpp"
#include "core/log.hpp"
#include "core/net_dev.hpp"
#include "core/timeline.hpp"
#include "ddp/iteration_record.hpp"

namespace cohort {
namespace {

namespace tl = core::timeline;

const core::Knob kMetrics{"COHORT_METRICS", "",
                          "file to append step metrics to as JSON lines (one per COHORT_METRICS_EVERY steps and a "
                          "\"summary\" line per rank at the end; StepMetrics, docs/observability.md); empty: off"};
const core::Knob kEvery{"COHORT_METRICS_EVERY", "0",
                        "every this many steps, StepMetrics logs the last steps' breakdown at INFO (DDP) and appends "
                        "a JSON line to COHORT_METRICS; 0: only the end-of-run summary",
                        core::KnobKind::Int};

struct Totals {
  int64_t steps = 0;
  int64_t step_ns = 0, data_ns = 0, exposed_ns = 0, comm_ns = 0;
  double bytes = 0;
  int nranks = 1;
};

double ms(double ns) {
  return ns / 1e6;
}

}  // namespace

struct COHORT_HIDDEN StepMetrics::Impl {
  ProcessGroup& group;
  std::string file;
  int64_t every = 0;
  int64_t begin_ns = 0, data_ns = 0;
  bool open = false, finished = false;
  Totals run, window;
  std::map<std::string, core::NetCounters> net_start;

  explicit Impl(ProcessGroup& g) : group(g), file(kMetrics.str()), every(kEvery.integer()) {
    if (every < 0)
      throw InvalidArgument(
          fmt::format("COHORT_METRICS_EVERY={} must be 0 (summary only) or a number of steps", every));
    net_start = core::read_net_dev();
  }

  StepSummary summarize(const Totals& t, bool with_net) const {
    StepSummary s;
    s.rank = group.rank();
    s.steps = t.steps;
    const double n = std::max<int64_t>(1, t.steps);
    s.step_ms = ms(t.step_ns / n);
    s.data_wait_ms = ms(t.data_ns / n);
    s.exposed_comm_ms = ms(t.exposed_ns / n);
    s.compute_ms = std::max(0.0, s.step_ms - s.data_wait_ms - s.exposed_comm_ms);
    s.comm_ms = ms(t.comm_ns / n);
    s.overlap_pct = t.comm_ns > 0 ? std::clamp(100.0 * (1.0 - double(t.exposed_ns) / t.comm_ns), 0.0, 100.0) : 0.0;
    s.grad_bytes = t.bytes / n;
    const double factor = t.nranks > 1 ? 2.0 * (t.nranks - 1) / t.nranks : 0.0;
    s.busbw_gbps = t.comm_ns > 0 ? t.bytes * factor / t.comm_ns : 0.0;  // bytes per ns = GB/s
    s.coll_sent_bytes = t.bytes * factor;
    if (with_net) {
      for (const auto& [name, now] : core::read_net_dev()) {
        auto it = net_start.find(name);
        const core::NetCounters before = it == net_start.end() ? core::NetCounters{} : it->second;
        InterfaceBytes ib{name, now.rx_bytes - before.rx_bytes, now.tx_bytes - before.tx_bytes};
        if (ib.rx != 0 || ib.tx != 0) s.net.push_back(ib);
      }
    }
    return s;
  }

  static nlohmann::json to_json(const StepSummary& s, const char* kind) {
    nlohmann::json j = {{"kind", kind},
                        {"rank", s.rank},
                        {"steps", s.steps},
                        {"step_ms", s.step_ms},
                        {"compute_ms", s.compute_ms},
                        {"exposed_comm_ms", s.exposed_comm_ms},
                        {"data_wait_ms", s.data_wait_ms},
                        {"comm_ms", s.comm_ms},
                        {"overlap_pct", s.overlap_pct},
                        {"grad_bytes", s.grad_bytes},
                        {"busbw_gbps", s.busbw_gbps},
                        {"coll_sent_bytes", s.coll_sent_bytes}};
    nlohmann::json net = nlohmann::json::object();
    for (const auto& i : s.net) net[i.name] = {{"rx_bytes", i.rx}, {"tx_bytes", i.tx}};
    if (std::string(kind) == "summary") j["net"] = net;
    return j;
  }

  // One write(2) per line on an O_APPEND file: lines of several ranks do not interleave.
  void append(const nlohmann::json& j) const {
    if (file.empty()) return;
    const std::string line = j.dump() + "\n";
    const core::Fd fd(::open(file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
    if (!fd.valid() || ::write(fd.get(), line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
      const int err = errno;
      COHORT_WARN(kDdp, "COHORT_METRICS: cannot append to {}: {}; HINT: is its directory there and writable?", file,
                  std::strerror(err));
      return;
    }
  }
};

StepMetrics::StepMetrics(ProcessGroup& group) : impl_(std::make_unique<Impl>(group)) {}

StepMetrics::~StepMetrics() {
  try {
    finish();
  } catch (...) {
  }
}

void StepMetrics::begin_step() {
  impl_->begin_ns = tl::now_ns();
  impl_->data_ns = 0;
  impl_->open = true;
}

void StepMetrics::data_ready() {
  if (!impl_->open) throw InvalidArgument("StepMetrics::data_ready() without begin_step(); call begin_step() first");
  impl_->data_ns = tl::now_ns();
}

void StepMetrics::cancel_step() {
  impl_->open = false;
}

void StepMetrics::end_step() {
  Impl& m = *impl_;
  if (!m.open) throw InvalidArgument("StepMetrics::end_step() without begin_step(); call begin_step() first");
  m.open = false;
  const int64_t end = tl::now_ns();
  const int64_t data_end = m.data_ns != 0 ? m.data_ns : m.begin_ns;
  Totals step;
  step.steps = 1;
  step.step_ns = end - m.begin_ns;
  step.data_ns = data_end - m.begin_ns;
  // The DDP iteration finalized inside this step (none under no_sync or without DDP).
  if (auto it = ddp::last_iteration(m.group); it && it->finalized_ns >= m.begin_ns && it->finalized_ns <= end) {
    step.exposed_ns = it->exposed_ns;
    step.comm_ns = it->comm_ns;
    step.bytes = static_cast<double>(it->bytes);
    step.nranks = it->nranks;
  }
  for (Totals* t : {&m.run, &m.window}) {
    t->steps += 1;
    t->step_ns += step.step_ns;
    t->data_ns += step.data_ns;
    t->exposed_ns += step.exposed_ns;
    t->comm_ns += step.comm_ns;
    t->bytes += step.bytes;
    t->nranks = std::max(t->nranks, step.nranks);
  }
  if (tl::enabled()) {
    tl::span("train", "step", "step", m.begin_ns, end, fmt::format(R"({{"step":{}}})", m.run.steps));
    if (m.data_ns != 0) tl::span("train", "data", "step", m.begin_ns, m.data_ns);
  }
  if (m.every > 0 && m.window.steps >= m.every) {
    StepSummary s = m.summarize(m.window, false);
    COHORT_INFO(kDdp,
                "steps {}..{}: {:.2f} ms/step = compute {:.2f} + exposed comm {:.2f} + data wait {:.2f}; overlap "
                "{:.0f}%, gradient busbw {:.2f} GB/s",
                m.run.steps - m.window.steps + 1, m.run.steps, s.step_ms, s.compute_ms, s.exposed_comm_ms,
                s.data_wait_ms, s.overlap_pct, s.busbw_gbps);
    auto j = Impl::to_json(s, "window");
    j["last_step"] = m.run.steps;
    m.append(j);
    m.window = Totals{};
  }
}

StepSummary StepMetrics::summary() const {
  return impl_->summarize(impl_->run, true);
}

std::string StepMetrics::report() const {
  const StepSummary s = summary();
  std::string o = fmt::format(
      "rank {}: {} steps, {:.2f} ms/step = compute {:.2f} + exposed communication {:.2f} + data wait {:.2f} ms\n"
      "rank {}: gradient allreduce {:.2f} ms/step in flight, {:.0f}% hidden behind backward; {:.2f} MB/step, busbw "
      "{:.2f} GB/s\n",
      s.rank, s.steps, s.step_ms, s.compute_ms, s.exposed_comm_ms, s.data_wait_ms, s.rank, s.comm_ms, s.overlap_pct,
      s.grad_bytes / 1e6, s.busbw_gbps);
  std::string net;
  for (const auto& i : s.net) net += fmt::format(" {} rx {:.1f} MB tx {:.1f} MB;", i.name, i.rx / 1e6, i.tx / 1e6);
  o += fmt::format(
      "rank {}: network over the run (/proc/net/dev, the whole host):{} collectives sent {:.1f} MB "
      "(over shared memory they cross no interface)\n",
      s.rank, net.empty() ? " no bytes;" : net, s.coll_sent_bytes / 1e6);
  return o;
}

void StepMetrics::finish() {
  if (impl_->finished) return;
  impl_->finished = true;
  const StepSummary s = summary();
  impl_->append(Impl::to_json(s, "summary"));
  if (core::log_enabled(core::LogLevel::Info, core::kDdp)) COHORT_INFO(kDdp, "metrics summary:\n{}", report());
}

}  // namespace cohort
