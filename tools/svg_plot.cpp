// SVG charts (svg_plot.hpp).
#include "svg_plot.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include "cohort/error.hpp"

namespace cohort::tools::svg {
namespace {

constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                                   "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"};
constexpr int kW = 720, kH = 420, kLeft = 70, kRight = 170, kTop = 40, kBottom = 55;

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '<')
      o += "&lt;";
    else if (c == '>')
      o += "&gt;";
    else if (c == '&')
      o += "&amp;";
    else if (c == '"')
      o += "&quot;";
    else
      o += c;
  }
  return o;
}

std::string header(int w, int h, const std::string& title) {
  return fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"{0}\" height=\"{1}\" fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">{3}</text>\n",
      w, h, w / 2, esc(title));
}

// A "nice" step (1, 2 or 5 x 10^k) giving about `n` ticks up to `max`.
double nice_step(double max, int n) {
  double raw = max / n;
  double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * p >= raw) return m * p;
  return 10 * p;
}

std::string num(double v) {
  if (v == std::floor(v) && std::fabs(v) < 1e9) return fmt::format("{}", static_cast<int64_t>(v));
  if (std::fabs(v) >= 100) return fmt::format("{:.0f}", v);
  return fmt::format("{:.3g}", v);
}

}  // namespace

std::string size_label(double bytes) {
  const char* units[] = {"", "K", "M", "G", "T"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  return num(bytes) + units[u];
}

std::string render(const LineChart& c) {
  double xmin = INFINITY, xmax = -INFINITY, ymax = 0;
  for (const auto& s : c.series) {
    if (s.x.size() != s.y.size())
      throw InvalidArgument(fmt::format("series '{}': {} x values but {} y values", s.name, s.x.size(), s.y.size()));
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (c.log2_x && s.x[i] <= 0) continue;
      xmin = std::min(xmin, s.x[i]);
      xmax = std::max(xmax, s.x[i]);
      ymax = std::max(ymax, s.y[i]);
    }
  }
  if (!(xmin <= xmax)) throw InvalidArgument("plot: no points to draw (every series is empty)");
  auto fx = [&](double x) { return c.log2_x ? std::log2(x) : x; };
  double lo = fx(xmin), hi = fx(xmax);
  if (hi == lo) hi = lo + 1;
  if (ymax <= 0) ymax = 1;
  const double ystep = nice_step(ymax, 5);
  const double ytop = std::ceil(ymax / ystep) * ystep;
  const int pw = kW - kLeft - kRight, ph = kH - kTop - kBottom;
  auto px = [&](double x) { return kLeft + (fx(x) - lo) / (hi - lo) * pw; };
  auto py = [&](double y) { return kTop + ph - y / ytop * ph; };

  std::string o = header(kW, kH, c.title);
  o += fmt::format("<g stroke=\"#ddd\">\n");
  for (double y = 0; y <= ytop + 1e-9; y += ystep)
    o += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\"/>\n", kLeft, py(y), kLeft + pw, py(y));
  o += "</g>\n<g text-anchor=\"end\">\n";
  for (double y = 0; y <= ytop + 1e-9; y += ystep)
    o += fmt::format("<text x=\"{}\" y=\"{:.1f}\">{}</text>\n", kLeft - 6, py(y) + 4, num(y));
  o += "</g>\n<g text-anchor=\"middle\">\n";
  if (c.log2_x) {
    int first = static_cast<int>(std::ceil(lo)), last = static_cast<int>(std::floor(hi));
    int every = std::max(1, (last - first) / 10 + 1);
    for (int e = first; e <= last; e += every)
      o += fmt::format("<text x=\"{:.1f}\" y=\"{}\">{}</text>\n", px(std::exp2(e)), kTop + ph + 18,
                       size_label(std::exp2(e)));
  } else {
    double step = nice_step(hi - lo, 8);
    for (double x = std::ceil(lo / step) * step; x <= hi + 1e-9; x += step)
      o += fmt::format("<text x=\"{:.1f}\" y=\"{}\">{}</text>\n", px(x), kTop + ph + 18, num(x));
  }
  o += "</g>\n";
  o += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#333\"/>\n", kLeft, kTop,
                   pw, ph);
  o += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", kLeft + pw / 2, kH - 12,
                   esc(c.x_label));
  o += fmt::format("<text x=\"16\" y=\"{}\" text-anchor=\"middle\" transform=\"rotate(-90 16 {})\">{}</text>\n",
                   kTop + ph / 2, kTop + ph / 2, esc(c.y_label));
  for (size_t k = 0; k < c.series.size(); ++k) {
    const auto& s = c.series[k];
    const char* col = kColors[k % std::size(kColors)];
    std::string pts;
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (c.log2_x && s.x[i] <= 0) continue;
      pts += fmt::format("{}{:.1f},{:.1f}", pts.empty() ? "" : " ", px(s.x[i]), py(s.y[i]));
    }
    o += fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\" points=\"{}\"/>\n", col, pts);
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (c.log2_x && s.x[i] <= 0) continue;
      o += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\" fill=\"{}\"/>\n", px(s.x[i]), py(s.y[i]), col);
    }
    const int ly = kTop + 10 + static_cast<int>(k) * 20;
    o += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"{}\" stroke-width=\"2\"/>\n",
                     kLeft + pw + 12, ly, kLeft + pw + 32, ly, col);
    o += fmt::format("<text x=\"{}\" y=\"{}\">{}</text>\n", kLeft + pw + 38, ly + 4, esc(s.name));
  }
  o += "</svg>\n";
  return o;
}

std::string render(const BarChart& c) {
  if (c.bars.empty()) throw InvalidArgument("plot: no bars to draw");
  std::vector<std::string> names;  // legend order: first appearance
  double vmax = 0;
  for (const auto& b : c.bars) {
    double total = 0;
    for (const auto& s : b.segments) {
      if (s.value < 0)
        throw InvalidArgument(fmt::format("bar '{}': segment '{}' is negative ({})", b.label, s.name, s.value));
      total += s.value;
      if (std::find(names.begin(), names.end(), s.name) == names.end()) names.push_back(s.name);
    }
    vmax = std::max(vmax, total);
  }
  if (vmax <= 0) vmax = 1;
  const int bar_h = 26, gap = 12;
  const int ph = static_cast<int>(c.bars.size()) * (bar_h + gap) + gap;
  const int h = kTop + ph + kBottom + 24, pw = kW - kLeft - kRight;  // legend in a row below the axis title
  const double step = nice_step(vmax, 5), vtop = std::ceil(vmax / step) * step;
  auto px = [&](double v) { return kLeft + v / vtop * pw; };
  std::string o = header(kW, h, c.title);
  o += "<g stroke=\"#ddd\">\n";
  for (double v = 0; v <= vtop + 1e-9; v += step)
    o += fmt::format("<line x1=\"{:.1f}\" y1=\"{}\" x2=\"{:.1f}\" y2=\"{}\"/>\n", px(v), kTop, px(v), kTop + ph);
  o += "</g>\n<g text-anchor=\"middle\">\n";
  for (double v = 0; v <= vtop + 1e-9; v += step)
    o += fmt::format("<text x=\"{:.1f}\" y=\"{}\">{}</text>\n", px(v), kTop + ph + 18, num(v));
  o += "</g>\n";
  o += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", kLeft + pw / 2, h - 36,
                   esc(c.value_label));
  for (size_t i = 0; i < c.bars.size(); ++i) {
    const auto& b = c.bars[i];
    const int y = kTop + gap + static_cast<int>(i) * (bar_h + gap);
    o += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>\n", kLeft - 6, y + bar_h / 2 + 4,
                     esc(b.label));
    double at = 0;
    for (const auto& s : b.segments) {
      size_t k = std::find(names.begin(), names.end(), s.name) - names.begin();
      o += fmt::format(
          "<rect x=\"{:.1f}\" y=\"{}\" width=\"{:.1f}\" height=\"{}\" fill=\"{}\"><title>{}: {}</title></rect>\n",
          px(at), y, px(at + s.value) - px(at), bar_h, kColors[k % std::size(kColors)], esc(s.name), num(s.value));
      at += s.value;
    }
    std::string parts;  // the numbers, readable without hovering: "272 = 195 + 73.8 + 3.22"
    for (const auto& s : b.segments) parts += (parts.empty() ? "" : " + ") + num(s.value);
    o += fmt::format("<text x=\"{:.1f}\" y=\"{}\" font-size=\"11\">{}{}</text>\n", px(at) + 4, y + bar_h / 2 + 4,
                     num(at), b.segments.size() > 1 ? " = " + parts : "");
  }
  int lx = kLeft;
  for (size_t k = 0; k < names.size(); ++k) {
    const int ly = h - 14;
    o += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"14\" height=\"14\" fill=\"{}\"/>\n", lx, ly - 11,
                     kColors[k % std::size(kColors)]);
    o += fmt::format("<text x=\"{}\" y=\"{}\">{}</text>\n", lx + 20, ly, esc(names[k]));
    lx += 20 + static_cast<int>(names[k].size()) * 7 + 24;
  }
  o += "</svg>\n";
  return o;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) throw Error(fmt::format("cannot write {}; HINT: does its directory exist and is it writable?", path));
}

}  // namespace cohort::tools::svg
