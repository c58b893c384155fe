// The layouts of plan_layouts: memory per device and the step time of each
// (docs/planning.md, "The step model").
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "cohort/error.hpp"
#include "plan/planner.hpp"

namespace cohort::plan {
namespace {

constexpr double kBucketBytes = 25.0 * 1024 * 1024;  // DDP's bucket_cap_mb

struct Evaluator {
  const ModelSpec& m;
  const ClusterSpec& c;
  const CostTable& table;
  GroupShape base;  // link classes, contention and the wire of the cluster
  collectives::Thresholds thresholds = collectives::thresholds_from_env();

  // A sub-group of `size` ranks whose members lie `stride` ranks apart
  // (ranks are numbered tp fastest, then dp, then pp, hosts in order).
  GroupShape sub_group(int size, int stride) const {
    GroupShape g = base;
    const int per_host = c.devices_per_host;
    if (stride >= per_host) {
      g.hosts = size;
      g.ranks_per_host = 1;
    } else {
      g.ranks_per_host = std::min(size, std::max(1, per_host / stride));
      g.hosts = std::max(1, size / g.ranks_per_host);
    }
    return g;
  }

  double coll_ms(Coll coll, double bytes, const GroupShape& g) const {
    if (g.nranks() <= 1 || bytes <= 0) return 0;
    return predict_collective(table, coll, bytes, g, thresholds).us / 1e3;
  }

  double memory_gb(const Layout& L) const {
    double w, g;
    const double k = bytes_per_param_state(w, g);
    const double p = m.params / (L.tp * L.pp);
    double states = p * w + p * g + p * k;
    if (L.zero == 1) states = p * (w + g) + p * k / L.dp;
    if (L.zero == 2) states = p * w + p * (g + k) / L.dp;
    if (L.zero == 3) {
      states = p * (w + g + k) / L.dp;
      // The gathered weights (and their gradients) of the layer that runs and the one prefetched;
      // a model that is not a transformer runs as one unit.
      states += m.layers > 0 ? 2 * (p / m.layers) * (w + g) : p * (w + g);
    }
    double act;
    const double b = L.micro_batch;
    if (m.layers > 0) {
      // Korthikanti et al. 2022, Table 2, per layer: s b h (10 + 24/t + 5 a s / (h t)) bytes (34 + 5as/h at
      // t = 1); with sequence parallelism s b h (34/t + 5 a s / (h t)); with full recomputation the layer's
      // input, 2 s b h (split t ways with sequence parallelism, as the runtime saves it).
      // The first stage holds the chunks its schedule has begun and not finished (pipeline.cpp's
      // warm-up, then one more forward): 1F1B min(p, m) micro-batches of L/p layers, L layers' worth when
      // m >= p; interleaved with v chunks min(2(p-1) + (v-1)p + 1, m v) chunks of L/(pv) layers, which is
      // L (1 + (p-1)/(pv)) when m > p, Korthikanti et al.'s factor (section 4.2.3).
      const double s = m.seq, h = m.hidden, a = m.heads, t = L.tp;
      const double full = L.sp ? s * b * h * (34 / t + 5 * a * s / (h * t)) : s * b * h * (10 + 24 / t + 5 * a * s / (h * t));
      const double per_layer = m.recompute ? 2 * s * b * h / (L.sp ? t : 1) : full;
      const int p = L.pp, v = L.chunks, mb = L.micro_batches;
      const int in_flight = v == 1 ? std::min(p, mb) : std::min(2 * (p - 1) + (v - 1) * p + 1, mb * v);
      act = per_layer * m.layers / (double(p) * v) * in_flight + (m.recompute ? full : 0) + 4 * s * b * m.vocab / t;  // fp32 logits
    } else {
      act = m.activation_bytes_per_sample * double(m.global_batch) / L.dp;
    }
    return (states + act) / kGB;
  }

  double bytes_per_param_state(double& w, double& g) const {
    const bool half = m.precision == "bf16" || m.precision == "fp16";
    w = half ? 2 : 4;
    g = half ? 2 : 4;
    return (half ? 4 : 0) + (m.optimizer == "adam" ? 8 : m.optimizer == "sgd" ? 4 : 0);
  }

  // Compute of one step on one device, with the pipeline's bubble.
  void compute(Layout& L) const {
    const double world = double(L.dp) * L.tp * L.pp;
    const double ideal_ms = m.sample_ms > 0 ? m.sample_ms * m.global_batch / world
                                            : m.flops_per_sample * m.global_batch /
                                                  (world * c.device_tflops * 1e12 * c.mfu) * 1e3;
    L.compute_ms = ideal_ms;
    // GPipe / 1F1B: (m + p - 1) slots of one micro-batch's work instead of m; interleaved with v chunks per
    // stage, slots of a chunk (1/v of it): (p - 1)/(v m) (Narayanan et al. 2021, section 2.2.2).
    L.bubble_ms = ideal_ms * (L.pp - 1) / (double(L.chunks) * L.micro_batches);
  }

  // The optimizer step: a fused update streams every state of the parameters this device updates
  // (all of its P/(tp pp), or 1/dp of them under ZeRO) through memory once, read and written back, and
  // reads the gradient and writes the 16-bit weights: 28 bytes per parameter for Adam, in fp32 or mixed
  // precision; 20 for SGD with momentum, 12 plain. 0 when the cluster gives no memory bandwidth, and
  // with --sample-ms, a measured step's time per sample that holds it already.
  void optimizer(Layout& L) const {
    if (c.memory_gbs <= 0 || m.sample_ms > 0) return;
    double w, g;
    const double k = bytes_per_param_state(w, g);  // the fp32 master (mixed precision) and the moments
    const bool half = m.precision == "bf16" || m.precision == "fp16";
    const double bytes = 2 * (half ? k : 4 + k) + g + (half ? w : 0);
    const double params = m.params / (L.tp * L.pp) / (L.zero >= 1 ? L.dp : 1);
    L.optimizer_ms = params * bytes / (c.memory_gbs * kGB) * 1e3;
  }

  void communication(Layout& L) const {
    const double act_bytes = double(L.micro_batch) * m.seq * m.hidden * 2;  // one micro-batch's activations, 16-bit
    if (L.tp > 1) {
      // Megatron: 2 allreduces forward, 2 backward per layer (+2 for the recomputed forward). Sequence
      // parallelism makes each an allgather and a reduce-scatter of the same bytes: the same bandwidth,
      // twice the calls.
      const double per_mb = (m.layers / double(L.pp)) * (m.recompute ? 6 : 4);
      const GroupShape tpg = sub_group(L.tp, 1);
      const double each = L.sp ? coll_ms(Coll::Allgather, act_bytes, tpg) + coll_ms(Coll::ReduceScatter, act_bytes, tpg)
                               : coll_ms(Coll::Allreduce, act_bytes, tpg);
      L.tp_ms = per_mb * L.micro_batches * each;
    }
    if (L.pp > 1) {
      // One send forward and one backward per micro-batch and stage boundary, on the critical path;
      // interleaved, per chunk: v times the micro-batches' sends (Narayanan et al. 2021, section 2.2.2).
      const GroupShape pair = sub_group(2, L.tp * L.dp);
      L.pp_ms = 2.0 * (double(L.chunks) * L.micro_batches + L.pp - 2) * coll_ms(Coll::Broadcast, act_bytes / L.tp, pair);
    }
    double w, g;
    bytes_per_param_state(w, g);
    const double grads = m.params / (L.tp * L.pp) * g, weights = m.params / (L.tp * L.pp) * w;
    const GroupShape dpg = sub_group(L.dp, L.tp);
    const double per_mb_ms = (L.compute_ms) / L.micro_batches;
    const double fwd = per_mb_ms / (m.recompute ? 4 : 3), bwd = per_mb_ms - fwd;
    const double buckets = std::max(1.0, std::ceil(grads / kBucketBytes));
    const double mbs = L.micro_batches;
    if (L.zero <= 1) {
      // DDP and ZeRO-1 keep whole gradients: they accumulate over the micro-batches and reduce once,
      // under the last micro-batch's backward (the last bucket waits for its end).
      const double ar = coll_ms(L.zero == 0 ? Coll::Allreduce : Coll::ReduceScatter, grads, dpg);
      const double ag = L.zero == 0 ? 0 : coll_ms(Coll::Allgather, weights, dpg);  // after the step
      L.dp_ms = ar + ag;
      L.dp_exposed_ms = std::max(ar - bwd, ar / buckets) + ag;
    } else if (L.zero == 2) {
      // A gradient shard only: every micro-batch's backward reduce-scatters.
      const double rs = coll_ms(Coll::ReduceScatter, grads, dpg), ag = coll_ms(Coll::Allgather, weights, dpg);
      L.dp_ms = mbs * rs + ag;
      L.dp_exposed_ms = mbs * std::max(rs - bwd, rs / buckets) + ag;
    } else {
      // Every micro-batch gathers the weights in forward and again in backward (twice with
      // recomputation), prefetched under compute, and reduce-scatters its gradients under backward.
      const double ag = coll_ms(Coll::Allgather, weights, dpg), rs = coll_ms(Coll::ReduceScatter, grads, dpg);
      const double bwd_ag = m.recompute ? 2 * ag : ag;
      L.dp_ms = mbs * (ag + bwd_ag + rs);
      L.dp_exposed_ms = mbs * (std::max(0.0, ag - fwd) + std::max((bwd_ag + rs) / buckets, bwd_ag + rs - bwd));
    }
  }

  int micro_batch(int dp) const { return m.micro_batch > 0 ? m.micro_batch : std::max(1, m.global_batch / dp); }
  int micro_batches(int dp) const { return std::max(1, m.global_batch / (dp * micro_batch(dp))); }

  Layout evaluate(int dp, int tp, int pp, int zero, int chunks, bool sp) const {
    Layout L{dp, tp, pp, zero, chunks, sp};
    L.micro_batch = micro_batch(dp);
    L.micro_batches = micro_batches(dp);
    L.memory_gb = memory_gb(L);
    L.fits = L.memory_gb <= c.device_memory_gb;
    compute(L);
    communication(L);
    optimizer(L);
    L.step_ms = L.compute_ms + L.bubble_ms + L.tp_ms + L.pp_ms + L.dp_exposed_ms + L.optimizer_ms;
    L.efficiency = L.compute_ms / L.step_ms;
    return L;
  }
};

// n's divisors, ascending, in sqrt(n) steps (a 64-bit counter: no wrap at INT_MAX).
std::vector<int> divisors(int n) {
  std::vector<int> low, high;
  for (int64_t d = 1; d * d <= n; ++d)
    if (n % d == 0) {
      low.push_back(int(d));
      if (d * d != n) high.push_back(int(n / d));
    }
  low.insert(low.end(), high.rbegin(), high.rend());
  return low;
}

}  // namespace

PlanResult plan_layouts(const ModelSpec& m, const ClusterSpec& c, const CostTable& table) {
  if (m.sample_ms <= 0 && c.device_tflops <= 0)
    throw InvalidArgument("the compute time needs a rate: give --device-tflops (the device's peak, with --mfu) or "
                          "--sample-ms (measured milliseconds per sample on one device), or a --cluster preset");
  Evaluator ev{m, c, table, group_shape(c)};
  const int world = c.hosts * c.devices_per_host;
  PlanResult r;
  for (int tp : divisors(c.devices_per_host)) {
    if (m.layers == 0 && tp > 1) break;
    if (m.layers > 0 && (m.heads % tp != 0)) continue;
    for (int pp : divisors(world / tp)) {
      if (m.layers == 0 && pp > 1) break;
      if (pp > 1 && (m.layers % pp != 0)) continue;
      const int dp = world / (tp * pp);
      if (m.global_batch % (dp * std::max(1, m.micro_batch)) != 0) continue;
      for (int zero = 0; zero <= 3; ++zero) {
        if (dp == 1 && zero > 0) break;
        if (zero >= 2 && pp > 1) break;               // a gradient shard cannot accumulate over micro-batches
        if (zero == 3 && (tp > 1 || pp > 1)) break;  // FSDP shards the whole model over dp
        for (int chunks : {1, 2, 4}) {
          // Interleaving (Megatron-LM's condition): v chunks of whole layers per stage, and micro-batches
          // in multiples of the stages.
          if (chunks > 1 && (pp == 1 || m.layers % (pp * chunks) != 0 || ev.micro_batches(dp) % pp != 0)) break;
          for (bool sp : {false, true})  // sequence parallelism splits the sequence tp ways
            if (!sp || (tp > 1 && m.seq % tp == 0)) r.layouts.push_back(ev.evaluate(dp, tp, pp, zero, chunks, sp));
        }
      }
    }
  }
  std::stable_sort(r.layouts.begin(), r.layouts.end(), [](const Layout& a, const Layout& b) {
    if (a.fits != b.fits) return a.fits;
    if (a.fits && a.step_ms != b.step_ms) return a.step_ms < b.step_ms;
    return a.memory_gb < b.memory_gb;  // and among equally fast ones, the one that needs less
  });
  if (r.layouts.empty())
    throw InvalidArgument(fmt::format("no layout of {} on {} x {} devices divides its batch of {} (with micro-batch {}): "
                                      "choose a global batch that the data-parallel size x micro-batch divides",
                                      m.name, c.hosts, c.devices_per_host, m.global_batch, std::max(1, m.micro_batch)));
  if (!r.layouts.front().fits) {
    const Layout& least = r.layouts.front();
    throw InvalidArgument(fmt::format(
        "{} ({:.3g}B parameters) fits no layout on {} host(s) x {} device(s) of {:.3g} GB: the one that needs least, "
        "{}, needs {:.1f} GB per device. Add hosts, use devices with more memory, {}or a smaller micro-batch",
        m.name, m.params / 1e9, c.hosts, c.devices_per_host, c.device_memory_gb, least.name(), least.memory_gb,
        m.layers > 0 && !m.recompute ? "turn on activation recomputation (--recompute), " : ""));
  }
  return r;
}

std::string format_plan(const ModelSpec& m, const ClusterSpec& c, const PlanResult& r, int top, bool csv) {
  std::string out;
  if (csv) {
    out = "layout,dp,tp,pp,zero,chunks,sp,fits,memory_gb,step_ms,compute_ms,bubble_ms,tp_ms,pp_ms,dp_ms,dp_exposed_ms,"
          "optimizer_ms,efficiency\n";
    for (const Layout& L : r.layouts)
      out += fmt::format("\"{}\",{},{},{},{},{},{},{},{:.3f},{:.3f},{:.3f},{:.3f},{:.3f},{:.3f},{:.3f},{:.3f},{:.3f},{:.4f}\n",
                         L.name(), L.dp, L.tp, L.pp, L.zero, L.chunks, L.sp ? 1 : 0, L.fits ? 1 : 0, L.memory_gb, L.step_ms,
                         L.compute_ms, L.bubble_ms, L.tp_ms, L.pp_ms, L.dp_ms, L.dp_exposed_ms, L.optimizer_ms, L.efficiency);
    return out;
  }
  const double world = double(c.hosts) * c.devices_per_host;
  out += fmt::format("# {}: {:.4g}B parameters, {:.4g} GFLOP per sample, batch {} on {} host(s) x {} device(s) of {:.3g} GB\n",
                     m.name, m.params / 1e9, m.flops_per_sample / 1e9, m.global_batch, c.hosts, c.devices_per_host,
                     c.device_memory_gb);
  if (m.sample_ms > 0)
    out += "# the optimizer step is in --sample-ms (a measured step's time per sample)\n";
  else if (c.memory_gbs <= 0)
    out += "# the optimizer step is not modelled: give --memory-gbs (the device's memory bandwidth) or a --cluster preset\n";
  out += fmt::format("# {:<44} {:>9} {:>10} {:>9} {:>9} {:>8} {:>8} {:>9} {:>8} {:>6} {:>10}\n", "layout", "mem GB",
                     "step ms", "compute", "bubble", "tp", "pp", "dp(exp)", "optim", "eff", "TFLOP/s/d");
  int shown = 0;
  for (const Layout& L : r.layouts) {
    if (!L.fits || shown++ >= top) break;
    const double tflops = m.flops_per_sample * m.global_batch / (world * L.step_ms * 1e-3) / 1e12;
    out += fmt::format("  {:<44} {:>9.2f} {:>10.2f} {:>9.2f} {:>9.2f} {:>8.2f} {:>8.2f} {:>9.2f} {:>8.2f} {:>5.0f}% {:>10.2f}\n",
                       L.name(), L.memory_gb, L.step_ms, L.compute_ms, L.bubble_ms, L.tp_ms, L.pp_ms, L.dp_exposed_ms,
                       L.optimizer_ms, 100 * L.efficiency, tflops);
  }
  const size_t nofit = size_t(std::count_if(r.layouts.begin(), r.layouts.end(), [](const Layout& L) { return !L.fits; }));
  if (nofit > 0) out += fmt::format("# {} more layout(s) do not fit in {:.3g} GB per device\n", nofit, c.device_memory_gb);
  return out;
}

}  // namespace cohort::plan
