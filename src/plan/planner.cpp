#include "plan/planner.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "cohort/error.hpp"

namespace cohort::plan {
namespace {


// Megatron-LM SC21 (Narayanan et al. 2021), Tables 1 and 2: heads, hidden, layers, global batch.
struct GptPreset {
  const char* name;
  int heads, hidden, layers, batch;
};
constexpr GptPreset kGpt[] = {{"gpt:1.7b", 24, 2304, 24, 512},   {"gpt:3.6b", 32, 3072, 30, 512},
                              {"gpt:7.5b", 32, 4096, 36, 512},   {"gpt:18.4b", 48, 6144, 40, 1024},
                              {"gpt:39.1b", 64, 8192, 48, 1536}, {"gpt:145.6b", 96, 12288, 80, 2304},
                              {"gpt:175b", 96, 12288, 96, 1536}};  // GPT-3, the paper's Table 2

ModelSpec preset_model(const std::string& name) {
  ModelSpec m;
  m.name = name;
  for (const GptPreset& g : kGpt) {
    if (name != g.name) continue;
    m.heads = g.heads;
    m.hidden = g.hidden;
    m.layers = g.layers;
    m.global_batch = g.batch;
    m.seq = 2048;
    m.vocab = 51200;
    m.recompute = true;  // as the paper's runs (its FLOPs formula counts the recomputation)
    return m;
  }
  if (name == "mlp") {  // examples/fashion_mnist --model mlp: 784-2048-2048-2048-10
    m.params = 784.0 * 2048 + 2048 + 2 * (2048.0 * 2048 + 2048) + 2048 * 10 + 10;
    m.flops_per_sample = 6 * m.params;
    m.activation_bytes_per_sample = 4.0 * 3 * (784 + 3 * 2048 + 10);
  } else if (name == "cnn") {  // --model cnn: conv 1-32-64 (3x3, pooling), fc 1600-128-10
    m.params = (32 * 9 + 32) + (64 * 32 * 9 + 64) + (1600.0 * 128 + 128) + (128 * 10 + 10);
    const double fwd = 2.0 * (26 * 26 * 32 * 9 + 11 * 11 * 64 * 32 * 9 + 1600 * 128 + 128 * 10);
    m.flops_per_sample = 3 * fwd;
    m.activation_bytes_per_sample = 4.0 * 3 * (26 * 26 * 32 + 13 * 13 * 32 + 11 * 11 * 64 + 1600 + 128);
  } else {
    std::string names;
    for (const GptPreset& g : kGpt) names += std::string(g.name) + ", ";
    throw InvalidArgument(fmt::format("--model {}: unknown preset; use {}mlp or cnn, or describe the model with --params "
                                      "(and --layers --hidden --heads --seq --vocab for a transformer)",
                                      name, names));
  }
  m.global_batch = 128;  // the example's 64 per rank on 2 ranks
  m.precision = "fp32";
  m.optimizer = "sgd";
  return m;
}

}  // namespace

double transformer_params(const ModelSpec& m) {
  const double l = m.layers, h = m.hidden, V = m.vocab, s = m.seq;
  return 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h));
}

double transformer_flops_per_sample(const ModelSpec& m) {
  const double l = m.layers, h = m.hidden, V = m.vocab, s = m.seq;
  if (m.recompute) return 96 * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h));
  return 72 * s * l * h * h * (1 + s / (6 * h)) + 6 * s * h * V;
}

ModelSpec model_spec(const ModelFlags& f) {
  ModelSpec m = f.preset.empty() ? ModelSpec{} : preset_model(f.preset);
  const ModelSpec& o = f.spec;  // explicit flags override the preset
  if (o.layers > 0) m.layers = o.layers;
  if (o.hidden > 0) m.hidden = o.hidden;
  if (o.heads > 0) m.heads = o.heads;
  if (o.seq > 0) m.seq = o.seq;
  if (o.vocab > 0) m.vocab = o.vocab;
  if (o.params > 0) m.params = o.params;
  if (o.flops_per_sample > 0) m.flops_per_sample = o.flops_per_sample;
  if (o.activation_bytes_per_sample > 0) m.activation_bytes_per_sample = o.activation_bytes_per_sample;
  if (o.sample_ms > 0) m.sample_ms = o.sample_ms;
  if (o.global_batch > 0) m.global_batch = o.global_batch;
  if (o.micro_batch > 0) m.micro_batch = o.micro_batch;
  if (m.micro_batch <= 0 && m.layers > 0) m.micro_batch = 1;
  if (!f.precision.empty()) m.precision = f.precision;
  if (!f.optimizer.empty()) m.optimizer = f.optimizer;
  if (f.recompute >= 0) m.recompute = f.recompute == 1;
  if (m.name.empty()) m.name = m.layers > 0 ? fmt::format("transformer {}x{}", m.layers, m.hidden) : "model";
  if (m.layers > 0) {
    if (m.hidden <= 0 || m.heads <= 0 || m.seq <= 0 || m.vocab <= 0)
      throw InvalidArgument("a transformer (--layers) needs --hidden, --heads, --seq and --vocab too");
    if (m.params <= 0) m.params = transformer_params(m);
    if (m.flops_per_sample <= 0) m.flops_per_sample = transformer_flops_per_sample(m);
  }
  if (m.params <= 0)
    throw InvalidArgument("--model: give a preset (e.g. --model gpt:7.5b) or the parameters (--params, and --layers "
                          "--hidden --heads --seq --vocab for a transformer)");
  if (m.flops_per_sample <= 0) m.flops_per_sample = 6 * m.params;  // dense layers: 2 forward + 4 backward per weight
  if (m.global_batch <= 0) throw InvalidArgument("--global-batch: the samples per step, all ranks together, must be > 0");
  if (m.precision != "bf16" && m.precision != "fp16" && m.precision != "fp32")
    throw InvalidArgument(fmt::format("--precision {}: bf16, fp16 or fp32", m.precision));
  if (m.optimizer != "adam" && m.optimizer != "sgd" && m.optimizer != "plain")
    throw InvalidArgument(fmt::format("--optimizer {}: adam, sgd (with momentum) or plain", m.optimizer));
  return m;
}

ClusterSpec resolve_cluster(const ClusterFlags& f) {
  ClusterSpec c = f.spec;
  if (f.preset == "a100-80g" || f.preset == "h100-80g") {
    const bool a100 = f.preset == "a100-80g";
    c.gpu = true;
    if (c.devices_per_host <= 0) c.devices_per_host = 8;
    if (c.device_memory_gb <= 0) c.device_memory_gb = 80 * 1.073741824;  // 80 GiB
    if (c.device_tflops <= 0) c.device_tflops = a100 ? 312 : 989;  // dense 16-bit tensor cores
    if (c.memory_gbs <= 0) c.memory_gbs = a100 ? 2039 : 3350;       // HBM2e / HBM3, SXM datasheets
    if (c.intra_gbs <= 0) c.intra_gbs = a100 ? 300 : 450;           // NVLink, each way (600 / 900 GB/s both)
    if (c.inter_gbps <= 0) c.inter_gbps = a100 ? 8 * 200 : 8 * 400;  // 8 HDR / NDR InfiniBand NICs per host
  } else if (!f.preset.empty()) {
    throw InvalidArgument(fmt::format("--cluster {}: unknown preset; use a100-80g or h100-80g, or describe the hosts "
                                      "with --gpus-per-host / --ranks-per-host, --device-memory-gb, --device-tflops",
                                      f.preset));
  }
  if (c.devices_per_host <= 0) c.devices_per_host = 1;
  if (c.hosts < 1)
    throw InvalidArgument(fmt::format("--hosts {}: a cluster has 1 or more hosts", c.hosts));
  // As `cohort run` starts at most 4096 workers per node; and a world that an int holds.
  constexpr int kMostPerHost = 4096;
  constexpr int64_t kMostDevices = int64_t(1) << 24;
  if (c.devices_per_host > kMostPerHost)
    throw InvalidArgument(fmt::format("--gpus-per-host / --ranks-per-host {}: at most {} per host", c.devices_per_host,
                                      kMostPerHost));
  if (int64_t(c.hosts) * c.devices_per_host > kMostDevices)
    throw InvalidArgument(fmt::format("--hosts {} x {} per host: more than {} devices in all; the model plans clusters up "
                                      "to that size",
                                      c.hosts, c.devices_per_host, kMostDevices));
  return c;
}

ClusterSpec cluster_spec(const ClusterFlags& f) {
  const ClusterSpec c = resolve_cluster(f);
  if (c.device_memory_gb <= 0)
    throw InvalidArgument("--device-memory-gb: the memory of one device (a GPU, or a CPU rank's share of its host) is "
                          "needed to tell which layouts fit");
  if (c.mfu <= 0 || c.mfu > 1) throw InvalidArgument(fmt::format("--mfu {}: a fraction of peak in (0, 1]", c.mfu));
  return c;
}

GroupShape group_shape(const ClusterSpec& c) {
  GroupShape g;
  g.hosts = c.hosts;
  g.ranks_per_host = std::max(1, c.devices_per_host);
  g.same_machine = c.same_machine;
  g.cross_gbps = c.gpu ? 0 : c.inter_gbps;
  if (c.gpu) {
    g.local = LinkClass::NcclLocal;
    g.cross = LinkClass::NcclCross;
    g.cores_per_host = g.ranks_per_host;  // one GPU each: no sharing
  }
  return g;
}

void apply_datasheet(CostTable& table, const ClusterSpec& c) {
  auto add = [&](LinkClass cls, double latency_us, double gbytes_per_s, int cores) {
    if (table.classes.count(cls) != 0 || gbytes_per_s <= 0) return;
    ClassCosts cc;
    cc.fits["*"] = AlgoCost{latency_us, 0, 1e6 / (gbytes_per_s * kGB), 0, 0};
    cc.cores = cores;
    cc.measured = fmt::format("datasheet: {:.3g} GB/s, {:.3g} us per step", gbytes_per_s, latency_us);
    table.classes[cls] = cc;
  };
  if (c.gpu) {
    if (c.intra_gbs <= 0 && table.classes.count(LinkClass::NcclLocal) == 0)
      throw InvalidArgument("a GPU cluster needs its links: give --intra-host-gbs (NVLink per GPU, GB/s each way) and, "
                            "across hosts, --inter-host-gbps, or a --cluster preset (a100-80g, h100-80g)");
    if (c.hosts > 1 && c.inter_gbps <= 0 && table.classes.count(LinkClass::NcclCross) == 0)
      throw InvalidArgument("a GPU cluster of several hosts needs --inter-host-gbps (each host's network, Gbit/s each "
                            "way), or a --cluster preset");
    // Each GPU has its own NIC (rail-optimised hosts): a flow gets the host's bandwidth / GPUs.
    const int gpus = std::max(1, c.devices_per_host);
    add(LinkClass::NcclLocal, c.intra_latency_us > 0 ? c.intra_latency_us : 5, c.intra_gbs, gpus);
    add(LinkClass::NcclCross, c.inter_latency_us > 0 ? c.inter_latency_us : 10, c.inter_gbps / 8 / gpus, gpus);
  } else if (c.inter_gbps > 0) {
    add(LinkClass::TcpCross, c.inter_latency_us > 0 ? c.inter_latency_us : 50, c.inter_gbps / 8, 1);
  }
  if (table.source.rfind("no calibration", 0) == 0 && !table.classes.empty()) table.source = "datasheet link speeds";
}

std::string Layout::name() const {
  if (tp == 1 && pp == 1)
    return zero == 0 ? fmt::format("DDP x{}", dp) : zero == 3 ? fmt::format("FSDP x{}", dp) : fmt::format("ZeRO-{} x{}", zero, dp);
  std::vector<std::string> notes;
  if (sp) notes.push_back("SP");
  if (chunks > 1) notes.push_back(fmt::format("{} chunks", chunks));
  if (zero > 0) notes.push_back(fmt::format("ZeRO-{}", zero));
  return fmt::format("TP {} x PP {} x DP {}{}", tp, pp, dp,
                     notes.empty() ? std::string() : fmt::format(" ({})", fmt::join(notes, ", ")));
}

}  // namespace cohort::plan
