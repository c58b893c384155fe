// `cohort plan`'s layouts (docs/planning.md): given a model and a cluster,
// the memory per device and the predicted step time of every data-parallel
// (DDP, ZeRO-1/2/3) and TP x PP x DP layout, ranked, from the cost model of
// the collectives (collective_time.hpp) and a compute rate.
#pragma once

#include <string>
#include <vector>

#include "plan/cost_model.hpp"
#include "plan/collective_time.hpp"

namespace cohort::plan {

inline constexpr double kGB = 1e9;  // the planner's GB (memory, bandwidth): 10^9 bytes

// A model: a decoder-only transformer (layers > 0: Megatron's formulas for
// FLOPs, parameters and activations), or any model given by parameters,
// FLOPs and activation bytes per sample (DP and ZeRO layouts only).
struct ModelSpec {
  std::string name;
  double params = 0;
  int layers = 0, hidden = 0, heads = 0, seq = 0, vocab = 0;
  double flops_per_sample = 0;             // forward + backward (+ recompute); 0: from the formula
  double activation_bytes_per_sample = 0;  // non-transformers
  double sample_ms = 0;                    // a measured whole step per sample on one device (overrides the FLOP rate)
  int global_batch = 0;                    // samples (sequences) per step, all ranks together
  int micro_batch = 0;                     // samples per micro-batch; 0: a rank's whole batch (transformers: 1)
  std::string precision = "bf16";          // bf16: 16-bit weights and grads, fp32 master + Adam; fp32
  std::string optimizer = "adam";          // adam, sgd (momentum), plain
  bool recompute = false;                  // full activation recomputation (transformers)
};

// The flags `cohort plan` fills: a preset name and overrides (numbers: > 0
// when given; the CLI refuses others).
struct ModelFlags {
  std::string preset;  // gpt:1.7b ... gpt:175b, mlp, cnn, or empty
  ModelSpec spec;      // its numbers
  std::string precision, optimizer;  // "" when not given
  int recompute = -1;                // -1 not given, 0 --no-recompute, 1 --recompute
};

struct ClusterSpec {
  int hosts = 1;
  int devices_per_host = 0;       // GPUs, or ranks (cores) on CPU hosts; 0: the preset's, else 1
  bool gpu = false;
  double device_memory_gb = 0;    // per device, in GB of 1e9 bytes
  double device_tflops = 0;       // peak per device for the model's precision
  double memory_gbs = 0;          // device memory bandwidth, GB/s: the optimizer step's rate; 0: not modelled
  double mfu = 0.5;               // the fraction of peak the model's kernels reach
  double intra_gbs = 0;           // GPUs: NVLink per GPU, GB/s each way
  double inter_gbps = 0;          // per host, Gbit/s each way (CPU: the wire limit of tcp_cross)
  double intra_latency_us = 0;    // per step; 0: the class's default
  double inter_latency_us = 0;
  bool same_machine = false;      // hosts are namespaces of one machine
};

struct ClusterFlags {
  ClusterSpec spec;
  std::string preset;  // a100-80g, h100-80g, or empty
};

ModelSpec model_spec(const ModelFlags& f);  // throws InvalidArgument on what is missing or wrong
// The cluster with its preset's values where a flag did not set them.
ClusterSpec resolve_cluster(const ClusterFlags& f);
// resolve_cluster, and what planning a model needs (memory, a sane MFU).
ClusterSpec cluster_spec(const ClusterFlags& f);
GroupShape group_shape(const ClusterSpec& c);  // the whole cluster as one group
// Adds datasheet classes from the cluster's link speeds where the table has
// no measurement: NCCL classes for GPU clusters, tcp_cross from
// --inter-host-gbps.
void apply_datasheet(CostTable& table, const ClusterSpec& c);

struct Layout {
  int dp = 1, tp = 1, pp = 1;
  int zero = 0;             // 0: DDP; 1, 2, 3 (FSDP)
  int chunks = 1;           // model chunks per pipeline stage (> 1: the interleaved 1F1B schedule)
  bool sp = false;          // sequence parallelism with tensor parallelism (Korthikanti et al. 2022)
  int micro_batch = 1;      // samples in one
  int micro_batches = 1;    // per step and pipeline
  double memory_gb = 0;     // per device
  double compute_ms = 0, bubble_ms = 0, tp_ms = 0, pp_ms = 0, dp_ms = 0, dp_exposed_ms = 0;
  double optimizer_ms = 0;  // the optimizer step over this device's parameters (or shard), memory-bound
  double step_ms = 0;
  double efficiency = 0;  // ideal compute / step time
  bool fits = false;
  std::string name() const;
};

struct PlanResult {
  std::vector<Layout> layouts;  // fitting ones first, each group fastest first
};

// Every layout of the model on the cluster. Throws InvalidArgument when none
// fits, naming the one that needs least memory and what it needs.
PlanResult plan_layouts(const ModelSpec& m, const ClusterSpec& c, const CostTable& table);
std::string format_plan(const ModelSpec& m, const ClusterSpec& c, const PlanResult& r, int top, bool csv);

// Megatron-LM's FLOPs per sequence (Narayanan et al. 2021, eq. 3 over B):
// 96 s l h^2 (1 + s/6h + V/16lh) with recomputation, 72 s l h^2 (1 + s/6h) +
// 6 s h V without.
double transformer_flops_per_sample(const ModelSpec& m);
double transformer_params(const ModelSpec& m);  // 12 l h^2 (1 + 13/12h + (V + s)/12lh), eq. 2

}  // namespace cohort::plan
