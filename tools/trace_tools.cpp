// Timeline merge and step breakdown (trace_tools.hpp).
#include "trace_tools.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <regex>
#include <sstream>

#include "cohort/error.hpp"
#include "svg_plot.hpp"

namespace cohort::tools::trace {
namespace fs = std::filesystem;
using nlohmann::json;

json read_rank_file(const std::string& path, bool* cut_short) {
  if (cut_short) *cut_short = false;
  std::ifstream in(path);
  if (!in) throw Error(fmt::format("cannot read {}", path));
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded()) {
    // Cut short: drop the trailing comma of the last whole line and close the array.
    size_t end = text.rfind("},");
    if (end != std::string::npos) j = json::parse(text.substr(0, end + 1) + "\n]", nullptr, false);
    if (cut_short && !j.is_discarded()) *cut_short = true;
  }
  if (j.is_object() && j.contains("traceEvents")) j = j["traceEvents"];
  if (j.is_discarded() || !j.is_array())
    throw Error(
        fmt::format("{} is not a cohort timeline (a JSON array of trace events); HINT: pass the directory "
                    "COHORT_TIMELINE pointed at",
                    path));
  return j;
}

json merge_dir(const std::string& dir) {
  if (!fs::is_directory(dir))
    throw Error(fmt::format("{} is not a directory; HINT: pass the directory COHORT_TIMELINE pointed at", dir));
  std::vector<fs::path> files;
  const std::regex name(R"((rank\d+|pid\d+)\.json)");
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file() && std::regex_match(e.path().filename().string(), name)) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  if (files.empty())
    throw Error(fmt::format("{} holds no rank<R>.json files; HINT: run the job with COHORT_TIMELINE={}", dir, dir));

  json events = json::array(), ranks = json::array();
  double t0 = std::numeric_limits<double>::infinity();
  for (const auto& f : files) {
    bool cut = false;
    json ev = read_rank_file(f.string(), &cut);
    double offset_us = 0;
    json info = {{"file", f.filename().string()}};
    if (cut) info["cut_short"] = true;
    for (const auto& e : ev)
      if (e.value("ph", "") == "M" && e.value("name", "") == "cohort_clock") {
        offset_us = e["args"].value("offset_ns", 0.0) / 1000.0;
        info["rank"] = e["args"].value("rank", -1);
        info["host"] = e["args"].value("host", "");
        info["clock"] = e["args"].value("method", "");
        info["offset_us"] = offset_us;
      }
    for (auto& e : ev) {
      if (e.value("ph", "") == "M") {
        if (e.value("name", "") != "cohort_end") events.push_back(e);
        continue;
      }
      e["ts"] = e.value("ts", 0.0) + offset_us;
      t0 = std::min(t0, e["ts"].get<double>());
      events.push_back(std::move(e));
    }
    ranks.push_back(info);
  }
  if (!std::isfinite(t0)) t0 = 0;
  for (auto& e : events)
    if (e.value("ph", "") != "M") e["ts"] = e["ts"].get<double>() - t0;
  return json{{"traceEvents", events},
              {"displayTimeUnit", "ms"},
              {"otherData", {{"cohort", {{"ranks", ranks}, {"start_us", t0}}}}}};
}

namespace {

struct Span {
  double ts, end;
};

double overlap(const Span& a, const Span& b) {
  return std::max(0.0, std::min(a.end, b.end) - std::max(a.ts, b.ts));
}

}  // namespace

std::vector<RankSummary> summarize(const json& merged) {
  const json& ev = merged.is_object() ? merged.at("traceEvents") : merged;
  std::map<int, std::vector<const json*>> by_rank;
  // DDP bucket allreduces in flight (async begin/end pairs), per rank: the communication that can hide behind backward.
  std::map<int, std::map<std::string, Span>> buckets;
  for (const auto& e : ev) {
    const std::string ph = e.value("ph", "");
    if (ph == "X") by_rank[e.value("pid", 0)].push_back(&e);
    if ((ph == "b" || ph == "e") && e.value("cat", "") == "bucket") {
      Span& b = buckets[e.value("pid", 0)][e.value("id", "")];
      (ph == "b" ? b.ts : b.end) = e.value("ts", 0.0);
    }
  }
  std::vector<RankSummary> out;
  for (auto& [rank, list] : by_rank) {
    RankSummary s;
    s.rank = rank;
    std::vector<Span> steps, data, waits, comm;
    double first = std::numeric_limits<double>::infinity(), last = 0;
    for (const json* e : list) {
      Span sp{e->value("ts", 0.0), e->value("ts", 0.0) + e->value("dur", 0.0)};
      first = std::min(first, sp.ts);
      last = std::max(last, sp.end);
      const std::string name = e->value("name", ""), cat = e->value("cat", "");
      if (cat == "step" && name == "step")
        steps.push_back(sp);
      else if (cat == "step" && name == "data")
        data.push_back(sp);
      else if (cat == "ddp" && name == "comm wait")
        waits.push_back(sp);
      else if (cat == "coll") {
        comm.push_back(sp);
        auto& o = s.ops[name];
        o.count++;
        o.ms += (sp.end - sp.ts) / 1000;
        o.bytes += e->contains("args") ? (*e)["args"].value("bytes", 0.0) : 0.0;
      }
    }
    if (auto it = buckets.find(rank); it != buckets.end()) {
      comm.clear();  // the reducer's view: from a bucket's launch to its completion
      for (const auto& [id, b] : it->second)
        if (b.end >= b.ts) comm.push_back(b);
    }
    // Union of the communication intervals, so that queued buckets are not counted twice.
    std::sort(comm.begin(), comm.end(), [](const Span& a, const Span& b) { return a.ts < b.ts; });
    std::vector<Span> merged;
    for (const auto& c : comm)
      if (!merged.empty() && c.ts <= merged.back().end)
        merged.back().end = std::max(merged.back().end, c.end);
      else
        merged.push_back(c);
    comm = merged;
    s.marked_steps = !steps.empty();
    if (steps.empty() && std::isfinite(first)) steps.push_back(Span{first, last});
    s.steps = static_cast<int>(steps.size());
    for (const auto& st : steps) {
      s.step_ms += (st.end - st.ts) / 1000;
      for (const auto& d : data) s.data_ms += overlap(st, d) / 1000;
      for (const auto& w : waits) s.exposed_ms += overlap(st, w) / 1000;
      for (const auto& c : comm) s.comm_ms += overlap(st, c) / 1000;
    }
    s.compute_ms = std::max(0.0, s.step_ms - s.data_ms - s.exposed_ms);
    s.overlap_pct = s.comm_ms > 0 ? std::clamp(100.0 * (1.0 - s.exposed_ms / s.comm_ms), 0.0, 100.0) : 0.0;
    out.push_back(std::move(s));
  }
  return out;
}

std::string format_summary(const std::vector<RankSummary>& all) {
  std::string o = fmt::format("{:>5} {:>6} {:>10} {:>11} {:>13} {:>10} {:>10} {:>8}\n", "rank", "steps", "step ms",
                              "compute ms", "exposed comm", "data wait", "comm ms", "overlap");
  for (const auto& s : all) {
    const double n = std::max(1, s.steps);
    o += fmt::format("{:>5} {:>6} {:>10.3f} {:>11.3f} {:>13.3f} {:>10.3f} {:>10.3f} {:>8}\n", s.rank, s.steps,
                     s.step_ms / n, s.compute_ms / n, s.exposed_ms / n, s.data_ms / n, s.comm_ms / n,
                     s.marked_steps ? fmt::format("{:.1f}%", s.overlap_pct) : "-");
  }
  o += "(per step, mean over the steps; comm ms: communication in flight, hidden or not: DDP buckets from launch to "
       "completion, else the collectives)\n";
  if (!all.empty() && !all[0].marked_steps)
    o += "no \"step\" spans in this trace (the program does not mark its steps): the whole trace counts as one step\n";
  // The slowest rank holds everyone's allreduces: the others see that wait as exposed communication.
  const RankSummary* lo = nullptr;
  const RankSummary* hi = nullptr;
  for (const auto& s : all) {
    if (s.steps == 0) continue;
    if (!lo || s.compute_ms / s.steps < lo->compute_ms / lo->steps) lo = &s;
    if (!hi || s.compute_ms / s.steps > hi->compute_ms / hi->steps) hi = &s;
  }
  if (lo && hi && all[0].marked_steps && lo->compute_ms > 0 &&
      hi->compute_ms / hi->steps > 1.1 * lo->compute_ms / lo->steps)
    o += fmt::format(
        "HINT: rank {} computes {:.0f}% longer per step than rank {}: the faster ranks' exposed "
        "communication is partly waiting for it (uneven data, CPU binding, a busy core?)\n",
        hi->rank, 100.0 * (hi->compute_ms / hi->steps / (lo->compute_ms / lo->steps) - 1), lo->rank);
  o += "\ncollectives (whole trace):\n";
  for (const auto& s : all)
    for (const auto& [name, st] : s.ops)
      o += fmt::format("  rank {} {:<15} {:>6} calls {:>10.3f} ms {:>14.0f} bytes\n", s.rank, name, st.count, st.ms,
                       st.bytes);
  return o;
}

std::string summary_svg(const std::vector<RankSummary>& all, const std::string& title) {
  svg::BarChart c;
  c.title = title;
  c.value_label = "milliseconds per step (mean)";
  for (const auto& s : all) {
    const double n = std::max(1, s.steps);
    c.bars.push_back(svg::Bar{
        fmt::format("rank {}", s.rank),
        {{"compute", s.compute_ms / n}, {"exposed communication", s.exposed_ms / n}, {"data wait", s.data_ms / n}}});
  }
  return svg::render(c);
}

}  // namespace cohort::tools::trace
