#include "plan/calibration.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cohort/error.hpp"

namespace cohort::plan {
namespace {

constexpr int kFormatVersion = 1;
constexpr const char* kFormat = "cohort-calibration";

// Solves the normal equations of the chosen columns (Gaussian elimination
// with partial pivoting; at most 3 unknowns). False when singular.
bool solve(std::vector<std::array<double, 3>>& a, std::vector<double>& b, int k) {
  double scale = 0;
  for (int i = 0; i < k; ++i)
    for (int j = 0; j < k; ++j) scale = std::max(scale, std::fabs(a[i][j]));
  for (int col = 0; col < k; ++col) {
    int piv = col;
    for (int r = col + 1; r < k; ++r)
      if (std::fabs(a[r][col]) > std::fabs(a[piv][col])) piv = r;
    // Relative to the matrix: columns that are (nearly) proportional, as alpha and beta when a band
    // holds a single size, have no split worth reporting; the smaller subsets cover them.
    if (std::fabs(a[piv][col]) <= 1e-9 * scale) return false;
    std::swap(a[piv], a[col]);
    std::swap(b[piv], b[col]);
    for (int r = 0; r < k; ++r) {
      if (r == col) continue;
      const double f = a[r][col] / a[col][col];
      for (int c = col; c < k; ++c) a[r][c] -= f * a[col][c];
      b[r] -= f * b[col];
    }
  }
  for (int i = 0; i < k; ++i) b[i] /= a[i][i];
  return true;
}

// One row per sample: the model's three terms over the measured time (so the
// fit minimises the sum of squared relative errors, from 8 B to 64 MiB alike).
std::vector<std::array<double, 3>> design_rows(const std::vector<Sample>& samples, int cores, double segment) {
  std::vector<std::array<double, 3>> rows;
  for (const Sample& s : samples) {
    const Shape sh = algo_shape(s.coll, s.algo, s.bytes, s.n, segment);
    const double excess = std::max(0, s.machine_ranks - std::max(1, cores));
    const double share = std::max(1.0, double(s.machine_ranks) / std::max(1, cores));
    rows.push_back({sh.steps / s.us, sh.steps * excess / s.us, sh.bytes * share / s.us});
  }
  return rows;
}

}  // namespace

AlgoCost fit_algo(const std::vector<Sample>& samples, int cores, double segment) {
  const auto rows = design_rows(samples, cores, segment);
  AlgoCost best;
  double best_sse = INFINITY;
  // Samples of one size only (a band the calibration reached with one size,
  // its largest; allgather's and reduce_scatter's bytes round down to a
  // multiple of n, hence the 1 %): per step (alpha, alpha_os) and per byte
  // (beta) cannot be told apart, and the per-step terms alone would give the
  // band an infinite bandwidth for the sizes above. In every band but the
  // smallest the time is taken as bytes, in the smallest as steps.
  const auto [lo, hi] = std::minmax_element(samples.begin(), samples.end(),
                                            [](const Sample& a, const Sample& b) { return a.bytes < b.bytes; });
  const bool one_size = !samples.empty() && hi->bytes <= 1.01 * lo->bytes;
  const int not_fitted = !one_size ? 0 : size_band(hi->bytes) > 0 ? 1 | 2 : 4;  // columns: 0 alpha, 1 alpha_os, 2 beta
  for (int mask = 1; mask < 8; ++mask) {
    if (mask & not_fitted) continue;
    std::vector<int> cols;
    for (int c = 0; c < 3; ++c)
      if (mask & (1 << c)) cols.push_back(c);
    const int k = int(cols.size());
    std::vector<std::array<double, 3>> ata(3, {0, 0, 0});
    std::vector<double> atb(3, 0);
    for (const auto& r : rows) {
      for (int i = 0; i < k; ++i) {
        for (int j = 0; j < k; ++j) ata[i][j] += r[cols[i]] * r[cols[j]];
        atb[i] += r[cols[i]];
      }
    }
    // Columns scaled to unit norm, so that the pivot tolerance compares like with like.
    std::array<double, 3> norm{1, 1, 1};
    for (int i = 0; i < k; ++i) norm[i] = ata[i][i] > 0 ? std::sqrt(ata[i][i]) : 1;
    for (int i = 0; i < k; ++i) {
      for (int j = 0; j < k; ++j) ata[i][j] /= norm[i] * norm[j];
      atb[i] /= norm[i];
    }
    if (!solve(ata, atb, k)) continue;
    std::array<double, 3> x{0, 0, 0};
    bool ok = true;
    for (int i = 0; i < k; ++i) {
      x[cols[i]] = atb[i] / norm[i];
      ok = ok && atb[i] >= 0;
    }
    if (!ok) continue;
    double sse = 0;
    for (const auto& r : rows) {
      const double e = r[0] * x[0] + r[1] * x[1] + r[2] * x[2] - 1;
      sse += e * e;
    }
    if (sse < best_sse) {
      best_sse = sse;
      best.alpha_us = x[0];
      best.alpha_os_us = x[1];
      best.beta_us_per_byte = x[2];
    }
  }
  best.points = int(samples.size());
  for (const auto& r : rows) {
    const double rel = std::fabs(r[0] * best.alpha_us + r[1] * best.alpha_os_us + r[2] * best.beta_us_per_byte - 1);
    best.max_rel_err = std::max(best.max_rel_err, rel);
  }
  return best;
}

ClassCosts fit_class(const ClassSamples& cs) {
  std::map<std::string, std::vector<Sample>> by_key;
  for (const Sample& s : cs.samples)
    if (s.n > 1 && s.us > 0) by_key[band_key(algo_key(s.coll, s.algo), size_band(s.bytes))].push_back(s);
  ClassCosts out;
  out.cores = cs.cores;
  out.single_copy = cs.single_copy;
  out.measured = cs.measured;
  for (auto& [key, samples] : by_key) out.fits[key] = fit_algo(samples, cs.cores, cs.segment);
  for (const Sample& s : cs.samples)
    if (s.n > 1 && s.us > 0)
      out.by_group[group_key(algo_key(s.coll, s.algo), s.n, s.machine_ranks)].emplace_back(s.bytes, s.us);
  for (auto& [key, pts] : out.by_group) {  // sorted by size; one point per size (the mean of repeats)
    std::sort(pts.begin(), pts.end());
    std::vector<std::pair<double, double>> merged;
    for (size_t i = 0; i < pts.size();) {
      size_t j = i;
      double sum = 0;
      for (; j < pts.size() && pts[j].first == pts[i].first; ++j) sum += pts[j].second;
      merged.emplace_back(pts[i].first, sum / double(j - i));
      i = j;
    }
    pts = std::move(merged);
  }
  return out;
}

namespace {
bool oversubscribed(const ClassSamples& cs) {
  return std::any_of(cs.samples.begin(), cs.samples.end(), [&](const Sample& s) { return s.machine_ranks > cs.cores; });
}
}  // namespace

CostTable cost_table(const Calibration& cal, const std::string& source) {
  CostTable t;
  t.source = source;
  for (const auto& [cls, cs] : cal.classes) t.classes[cls] = fit_class(cs);
  // The wait for a core is the machine's, not the link's: a class measured
  // only with a core per rank takes alpha_os from one that was measured
  // oversubscribed (the mean over its algorithms).
  double sum = 0;
  int count = 0;
  for (const auto& [cls, cs] : cal.classes) {
    if (!oversubscribed(cs)) continue;
    for (const auto& [key, fit] : t.classes[cls].fits) {
      if (fit.alpha_os_us <= 0) continue;  // no oversubscribed samples in this band, or none needed
      sum += fit.alpha_os_us;
      ++count;
    }
  }
  if (count == 0) return t;
  for (const auto& [cls, cs] : cal.classes) {
    if (oversubscribed(cs)) continue;
    for (auto& [key, fit] : t.classes[cls].fits) fit.alpha_os_us = sum / count;
  }
  return t;
}

std::string calibration_json(const Calibration& cal) {
  nlohmann::ordered_json j;
  j["format"] = kFormat;
  j["format_version"] = kFormatVersion;
  j["cohort_version"] = cal.cohort_version;
  nlohmann::ordered_json classes = nlohmann::ordered_json::object();
  for (const auto& [cls, cs] : cal.classes) {
    nlohmann::ordered_json c;
    c["cores"] = cs.cores;
    c["single_copy"] = cs.single_copy;
    c["segment"] = cs.segment;
    c["measured"] = cs.measured;
    nlohmann::ordered_json fits = nlohmann::ordered_json::object();
    for (const auto& [key, f] : fit_class(cs).fits)
      fits[key] = {{"alpha_us", f.alpha_us},
                   {"alpha_os_us", f.alpha_os_us},
                   {"beta_us_per_byte", f.beta_us_per_byte},
                   {"points", f.points},
                   {"max_rel_err", f.max_rel_err}};
    c["fits"] = fits;
    nlohmann::ordered_json samples = nlohmann::ordered_json::array();
    for (const Sample& s : cs.samples)
      samples.push_back({collectives::coll_name(s.coll), collectives::algo_name(s.algo), s.n, s.machine_ranks, s.bytes,
                         s.us});
    c["samples"] = samples;
    classes[link_class_name(cls)] = c;
  }
  j["classes"] = classes;
  return j.dump(1) + "\n";
}

void write_calibration(const std::string& path, const Calibration& cal) {
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  {
    std::ofstream out(tmp);
    out << calibration_json(cal);
    if (!out.flush()) throw InvalidArgument(fmt::format("cannot write the calibration file {}", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw InvalidArgument(fmt::format("cannot rename {} to {}", tmp, path));
}

namespace {

Sample parse_sample(const nlohmann::json& s, const std::string& where) {
  if (!s.is_array() || s.size() != 6)
    throw InvalidArgument(fmt::format("{}: a sample is [coll, algo, n, machine_ranks, bytes, us]", where));
  Sample out;
  auto coll = collectives::parse_coll(s[0].get<std::string>());
  auto algo = collectives::parse_algo(s[1].get<std::string>());
  if (!coll || !algo) throw InvalidArgument(fmt::format("{}: unknown collective or algorithm in {}", where, s.dump()));
  out.coll = *coll;
  out.algo = *algo;
  out.n = s[2].get<int>();
  out.machine_ranks = s[3].get<int>();
  out.bytes = s[4].get<double>();
  out.us = s[5].get<double>();
  // What `cohort bench --calibrate` writes; anything else was edited or damaged.
  if (out.n < 1 || out.machine_ranks < 1 || out.machine_ranks > out.n || !std::isfinite(out.bytes) || out.bytes < 0 ||
      !std::isfinite(out.us) || out.us <= 0)
    throw InvalidArgument(fmt::format("{}: the sample {} is not a measurement (ranks >= 1, ranks on the machine "
                                      "between 1 and the ranks, bytes >= 0, microseconds > 0): the file was edited "
                                      "or damaged; calibrate again into a new file",
                                      where, s.dump()));
  return out;
}

}  // namespace

Calibration read_calibration(const std::string& path, const std::string& expect_version) {
  std::ifstream in(path);
  if (!in)
    throw InvalidArgument(fmt::format("calibration file {}: cannot read it; make one with `cohort run --nproc-per-node 2 "
                                      "cohort bench --calibrate {}`",
                                      path, path));
  std::stringstream ss;
  ss << in.rdbuf();
  Calibration cal;
  try {
    const auto j = nlohmann::json::parse(ss.str());
    if (!j.is_object() || j.value("format", "") != kFormat)
      throw InvalidArgument(fmt::format("{} is not a cohort calibration file (no \"format\": \"{}\")", path, kFormat));
    const int fv = j.value("format_version", 0);
    if (fv != kFormatVersion)
      throw InvalidArgument(fmt::format("calibration file {} has format version {}; this cohort reads version {}: run "
                                        "`cohort bench --calibrate {}` again",
                                        path, fv, kFormatVersion, path));
    cal.cohort_version = j.value("cohort_version", "");
    if (cal.cohort_version != expect_version)
      throw InvalidArgument(fmt::format(
          "calibration file {} was measured by cohort {}, and this is cohort {}: its algorithms and thresholds may "
          "differ, so its times do not apply; calibrate again with `cohort bench --calibrate {}` (under `cohort run`, "
          "for each link class you use)",
          path, cal.cohort_version.empty() ? "(unknown)" : cal.cohort_version, expect_version, path));
    for (const auto& [name, c] : j.at("classes").items()) {
      auto cls = parse_link_class(name);
      if (!cls) throw InvalidArgument(fmt::format("calibration file {}: unknown link class '{}'", path, name));
      ClassSamples cs;
      cs.cores = c.value("cores", 1);
      cs.single_copy = c.value("single_copy", false);
      cs.segment = c.value("segment", 256.0 * 1024);
      if (cs.cores < 1 || !(cs.segment > 0) || !std::isfinite(cs.segment))
        throw InvalidArgument(fmt::format("calibration file {} class {}: cores {} and segment {} must be >= 1 and > 0: "
                                          "the file was edited or damaged; calibrate again into a new file",
                                          path, name, cs.cores, cs.segment));
      cs.measured = c.value("measured", "");
      for (const auto& s : c.at("samples")) cs.samples.push_back(parse_sample(s, path + " class " + name));
      cal.classes[*cls] = std::move(cs);
    }
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(fmt::format("calibration file {} is damaged ({}); calibrate again with `cohort bench "
                                      "--calibrate {}`",
                                      path, e.what(), path));
  }
  return cal;
}

void merge_samples(Calibration& cal, LinkClass cls, const ClassSamples& fresh) {
  ClassSamples& cs = cal.classes[cls];
  if (!fresh.samples.empty()) {
    const int n = fresh.samples.front().n, m = fresh.samples.front().machine_ranks;
    std::erase_if(cs.samples, [&](const Sample& s) { return s.n == n && s.machine_ranks == m; });
  }
  cs.samples.insert(cs.samples.end(), fresh.samples.begin(), fresh.samples.end());
  cs.cores = fresh.cores;
  cs.single_copy = fresh.single_copy;
  cs.segment = fresh.segment;
  cs.measured = fresh.measured;
}

}  // namespace cohort::plan
