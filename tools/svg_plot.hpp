// A small SVG writer for cohort's pictures: line charts (busbw against message
// size, `cohort bench --plot`) and stacked horizontal bars (the per-rank step
// breakdown, `cohort trace summary --svg`).
//
// Why our own and not gnuplot: no run-time dependency for a picture, and the
// output is byte-for-byte stable (no dates, fonts or versions in it), so SVGs
// committed under docs/img/ only change when the numbers do. Plain SVG 1.1
// that browsers and GitHub render.
#pragma once

#include <string>
#include <vector>

namespace cohort::tools::svg {

struct Series {
  std::string name;
  std::vector<double> x, y;  // same length; points with y <= 0 on a log axis are skipped
};

struct LineChart {
  std::string title, x_label, y_label;
  bool log2_x = true;  // message sizes double: a log2 axis with 1K/1M/... ticks
  std::vector<Series> series;
};

struct BarSegment {
  std::string name;  // legend entry (same names, same colours across bars)
  double value;
};
struct Bar {
  std::string label;  // "rank 0"
  std::vector<BarSegment> segments;
};
struct BarChart {
  std::string title, value_label;
  std::vector<Bar> bars;
};

// The SVG document text. Throws InvalidArgument for a chart with nothing to draw.
std::string render(const LineChart& c);
std::string render(const BarChart& c);

// Writes text to path; throws Error naming the path and the reason.
void write_file(const std::string& path, const std::string& text);

// "4", "64K", "1M", "256M": size labels for the log2 axis.
std::string size_label(double bytes);

}  // namespace cohort::tools::svg
