#include "plan/cost_model.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "cohort/error.hpp"

namespace cohort::plan {

const char* link_class_name(LinkClass c) {
  switch (c) {
    case LinkClass::Shm: return "shm";
    case LinkClass::TcpLocal: return "tcp_local";
    case LinkClass::TcpCross: return "tcp_cross";
    case LinkClass::NcclLocal: return "nccl_local";
    case LinkClass::NcclCross: return "nccl_cross";
  }
  return "?";
}

std::vector<LinkClass> all_link_classes() {
  return {LinkClass::Shm, LinkClass::TcpLocal, LinkClass::TcpCross, LinkClass::NcclLocal, LinkClass::NcclCross};
}

std::optional<LinkClass> parse_link_class(const std::string& s) {
  for (LinkClass c : all_link_classes())
    if (s == link_class_name(c)) return c;
  return std::nullopt;
}

std::string algo_key(Coll c, Algo a) { return std::string(collectives::coll_name(c)) + "/" + collectives::algo_name(a); }

namespace {
double ceil_log2(int n) { return n <= 1 ? 0.0 : std::ceil(std::log2(double(n))); }
}  // namespace

Shape algo_shape(Coll c, Algo a, double S, int n, double segment) {
  if (n <= 1) return {};
  const double nm1 = n - 1, frac = nm1 / n;
  switch (a) {
    case Algo::Ring:
      if (c == Coll::Allreduce) return {2 * nm1, 2 * frac * S};
      return {nm1, frac * S};  // allgather, reduce_scatter: one half of the allreduce
    case Algo::RecursiveDoubling: {
      int p = 1;
      while (p * 2 <= n) p *= 2;
      // The ranks beyond the largest power of two fold in first and get the result last.
      const double steps = std::log2(double(p)) + (p < n ? 2 : 0);
      return {steps, steps * S};
    }
    case Algo::Binomial: return {ceil_log2(n), ceil_log2(n) * S};
    case Algo::Pipeline: {
      const double seg = std::min(segment, std::max(S, 1.0));
      const double nseg = std::max(1.0, std::ceil(S / seg));
      const double steps = nseg + n - 2;
      return {steps, steps * seg};
    }
    case Algo::SingleCopy:
      // Two small exchanges (addresses, the final word); allreduce reads its
      // block from every peer and writes it back to every peer.
      if (c == Coll::Allreduce) return {2, (2.0 * n - 1) / n * S};
      return {2, frac * S};
    case Algo::Direct:
    case Algo::Linear: return {nm1, frac * S};
    case Algo::Dissemination: return {ceil_log2(n), 0};
    case Algo::Hierarchical: break;
  }
  throw InvalidArgument(fmt::format("the cost model has no closed form for {} by {}: it is composed of its phases",
                                    collectives::coll_name(c), collectives::algo_name(a)));
}

double cost_us(const AlgoCost& a, const Shape& s, const Contention& c) {
  const int cores = std::max(1, c.cores);
  const double excess = std::max(0, c.machine_ranks - cores);
  const double share = std::max(1.0, double(c.machine_ranks) / cores);
  return s.steps * (a.alpha_us + a.alpha_os_us * excess) + s.bytes * a.beta_us_per_byte * share;
}

int size_band(double bytes) {
  for (int b = 0; b < kBands - 1; ++b)
    if (bytes <= kBandEdges[b]) return b;
  return kBands - 1;
}

const char* band_name(int band) {
  static const char* const names[kBands] = {"small", "medium", "large", "huge"};
  return band >= 0 && band < kBands ? names[band] : "?";
}

std::string band_key(const std::string& key, int band) { return key + "@" + band_name(band); }

std::string group_key(const std::string& key, int n, int machine_ranks) {
  return fmt::format("{}@n{}m{}", key, n, machine_ranks);
}

std::optional<double> ClassCosts::at_measured_group(const std::string& key, double bytes, int n,
                                                    int machine_ranks) const {
  auto it = by_group.find(group_key(key, n, machine_ranks));
  if (it == by_group.end() || it->second.size() < 2) return std::nullopt;
  const auto& pts = it->second;
  // Only between the sizes measured: outside them (the tuner picks another algorithm there, or the
  // calibration stopped) a line through two noisy end points says little; the fit answers.
  if (bytes < pts.front().first || bytes > pts.back().first) return std::nullopt;
  const auto above = std::lower_bound(pts.begin(), pts.end(), bytes,
                                      [](const std::pair<double, double>& p, double b) { return p.first < b; });
  const size_t i = std::clamp<size_t>(size_t(above - pts.begin()), 1, pts.size() - 1);
  const auto [b0, t0] = pts[i - 1];
  const auto [b1, t1] = pts[i];
  // The group's steps are the same at both sizes (n is fixed), so the line through the two points
  // is steps * alpha + bytes * beta with the alpha and beta of this interval.
  return t0 + (bytes - b0) * (t1 - t0) / (b1 - b0);
}

const AlgoCost* ClassCosts::find(const std::string& key, double bytes) const {
  const int b = size_band(bytes);
  for (int d = 0; d < kBands; ++d)
    for (int band : {b - d, b + d}) {
      if (band < 0 || band >= kBands) continue;
      auto it = fits.find(band_key(key, band));
      if (it != fits.end()) return &it->second;
    }
  auto it = fits.find("*");
  return it == fits.end() ? nullptr : &it->second;
}

}  // namespace cohort::plan
