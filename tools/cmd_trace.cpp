// `cohort trace merge DIR -o job.json` and `cohort trace summary job.json [--svg F]`.
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "cohort/error.hpp"
#include "commands.hpp"
#include "svg_plot.hpp"
#include "trace_tools.hpp"

namespace cohort::tools {

void add_trace_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("trace", "join and read timelines written with COHORT_TIMELINE=DIR");
  cmd->require_subcommand(1);

  auto* merge = cmd->add_subcommand("merge",
                                    "join DIR/rank*.json into one Chrome trace (one track group per rank, "
                                    "clocks aligned); open it in https://ui.perfetto.dev");
  static std::string dir, out;
  merge->add_option("dir", dir, "the COHORT_TIMELINE directory")->required();
  merge->add_option("-o,--output", out, "merged trace file")->required();
  merge->callback([&exit_code] {
    auto j = trace::merge_dir(dir);
    std::ofstream f(out, std::ios::trunc);
    f << j.dump() << "\n";
    f.close();
    if (!f) throw Error(fmt::format("cannot write {}; HINT: does its directory exist?", out));
    std::printf("%s: %zu events from %zu rank(s)\n", out.c_str(), j["traceEvents"].size(),
                j["otherData"]["cohort"]["ranks"].size());
    for (const auto& r : j["otherData"]["cohort"]["ranks"])
      if (r.value("cut_short", false))
        std::fprintf(stderr, "note: %s was cut short (its process did not close it: killed, or still running); "
                     "its whole events are merged, the last partial one dropped\n",
                     r.value("file", std::string("?")).c_str());
    exit_code = 0;
  });

  auto* sum = cmd->add_subcommand("summary", "per-rank step breakdown: compute, exposed communication, data wait");
  static std::string in, svg_out, title = "Where a step spends its time, per rank";
  sum->add_option("trace", in, "merged trace (cohort trace merge) or a COHORT_TIMELINE directory")->required();
  sum->add_option("--svg", svg_out, "also draw the breakdown as an SVG bar chart");
  sum->add_option("--title", title, "the chart's title (say which run it is)");
  sum->callback([&exit_code] {
    nlohmann::json j;
    if (std::filesystem::is_directory(in)) {
      j = trace::merge_dir(in);
    } else {
      std::ifstream f(in);
      if (!f) throw Error(fmt::format("cannot read {}", in));
      j = nlohmann::json::parse(f, nullptr, false);
      if (j.is_discarded() || !j.contains("traceEvents"))
        throw Error(
            fmt::format("{} is not a merged trace; HINT: make one with `cohort trace merge DIR -o {}`", in, in));
    }
    auto s = trace::summarize(j);
    std::fputs(trace::format_summary(s).c_str(), stdout);
    if (!svg_out.empty()) {
      svg::write_file(svg_out, trace::summary_svg(s, title));
      std::printf("wrote %s\n", svg_out.c_str());
    }
    exit_code = 0;
  });
}

}  // namespace cohort::tools
