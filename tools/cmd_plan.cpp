// `cohort plan`: the cost model's answers (docs/planning.md). Two questions:
//   cohort plan --collective allreduce --sizes 8,1M,64M --hosts 2 --ranks-per-host 4 --calibration cal.json
//     the predicted time of one collective, per size, and the algorithm the tuner runs;
//   cohort plan --model gpt:7.5b --hosts 16 --gpus-per-host 8 ...
//     the step time, memory and scaling efficiency of every DP, ZeRO and TP x PP x DP layout that fits,
//     best first.
#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <sstream>

#include "collectives/tuner.hpp"
#include "cohort/error.hpp"
#include "commands.hpp"
#include "core/env.hpp"
#include "plan/calibration.hpp"
#include "plan/collective_time.hpp"
#include "plan/planner.hpp"

namespace cohort::tools {
namespace {

struct PlanFlags {
  std::string calibration;
  std::string collective;
  std::string sizes = "8,1K,64K,1M,16M,64M";
  bool csv = false;
  std::string transport = "shm";
  plan::ClusterFlags cluster;
  plan::ModelFlags model;
  int top = 10;
};

plan::CostTable load_costs(const PlanFlags& f) {
  if (f.calibration.empty()) return plan::CostTable{"no calibration file (--calibration)", {}};
  return plan::cost_table(plan::read_calibration(f.calibration, COHORT_VERSION), "calibration file " + f.calibration);
}

// A finite number > 0 (CLI11's PositiveNumber lets "nan" through, and its
// Range names the largest double in its message).
CLI::Validator finite_above(double low, double high = HUGE_VAL) {
  return CLI::Validator(
      [low, high](std::string& text) -> std::string {
        char* end = nullptr;
        const double x = std::strtod(text.c_str(), &end);
        if (end == text.c_str() || *end != '\0' || !std::isfinite(x) || !(x > low) || x > high)
          return std::isfinite(high) ? fmt::format("expected a number in ({}, {}], got {}", low, high, text)
                                     : fmt::format("expected a finite number > {}, got {}", low, text);
        return "";
      },
      "");
}

void add_cluster_options(CLI::App& cmd, plan::ClusterFlags& c) {
  const auto positive = finite_above(0);
  cmd.add_option("--cluster", c.preset, "a100-80g or h100-80g: 8 GPUs per host, NVLink, 8 InfiniBand NICs (datasheet)");
  cmd.add_option("--hosts", c.spec.hosts, "hosts (machines)")->check(positive);
  auto* gpus = cmd.add_option("--gpus-per-host", c.spec.devices_per_host, "GPUs per host (NCCL)")->check(positive);
  gpus->each([&c](const std::string&) { c.spec.gpu = true; });
  cmd.add_option("--ranks-per-host", c.spec.devices_per_host, "CPU ranks per host (shm inside, TCP between hosts)")
      ->check(positive)
      ->excludes(gpus);
  cmd.add_option("--device-memory-gb", c.spec.device_memory_gb, "memory of one device in GB (1e9 bytes): a GPU, or a "
                                                                "CPU rank's share of its host")
      ->check(positive);
  cmd.add_option("--device-tflops", c.spec.device_tflops, "peak TFLOP/s of one device in the model's precision")
      ->check(positive);
  cmd.add_option("--memory-gbs", c.spec.memory_gbs,
                 "memory bandwidth of one device in GB/s (a GPU's HBM, or a CPU rank's share): the optimizer step's rate")
      ->check(positive);
  cmd.add_option("--mfu", c.spec.mfu, "the fraction of that peak the model's kernels reach, in (0, 1] (default 0.5)")
      ->check(finite_above(0, 1.0));
  cmd.add_option("--intra-host-gbs", c.spec.intra_gbs, "GPU-to-GPU bandwidth inside a host, GB/s each way per GPU")
      ->check(positive);
  cmd.add_option("--inter-host-gbps", c.spec.inter_gbps,
                 "each host's network, Gbit/s each way (CPU: the wire limit on top of the calibrated tcp_cross)")
      ->check(positive);
  cmd.add_option("--intra-latency-us", c.spec.intra_latency_us, "datasheet latency per step inside a host")->check(positive);
  cmd.add_option("--inter-latency-us", c.spec.inter_latency_us, "datasheet latency per step between hosts")->check(positive);
}

void add_model_options(CLI::App& cmd, plan::ModelFlags& m) {
  const auto positive = finite_above(0);
  cmd.add_option("--model", m.preset, "gpt:1.7b, gpt:3.6b, gpt:7.5b, gpt:18.4b, gpt:39.1b, gpt:145.6b, gpt:175b (Megatron-LM's "
                                      "Table 1), mlp or cnn (examples/fashion_mnist); flags below override it");
  cmd.add_option("--params", m.spec.params, "parameters")->check(positive);
  cmd.add_option("--layers", m.spec.layers, "transformer layers")->check(positive);
  cmd.add_option("--hidden", m.spec.hidden, "hidden size")->check(positive);
  cmd.add_option("--heads", m.spec.heads, "attention heads")->check(positive);
  cmd.add_option("--seq", m.spec.seq, "sequence length")->check(positive);
  cmd.add_option("--vocab", m.spec.vocab, "vocabulary size")->check(positive);
  cmd.add_option("--flops-per-sample", m.spec.flops_per_sample, "training FLOPs per sample (default: the formula, or 6 x params)")->check(positive);
  cmd.add_option("--activation-bytes", m.spec.activation_bytes_per_sample, "activation bytes per sample (non-transformers)")->check(positive);
  cmd.add_option("--sample-ms", m.spec.sample_ms,
                 "measured milliseconds per sample of a whole step on one device, optimizer included (instead of FLOPs / peak)")->check(positive);
  cmd.add_option("--global-batch", m.spec.global_batch, "samples per step, all ranks together")->check(positive);
  cmd.add_option("--micro-batch", m.spec.micro_batch, "samples per micro-batch")->check(positive);
  cmd.add_option("--precision", m.precision, "bf16 (16-bit weights and grads, fp32 master; the default), fp16 or fp32");
  cmd.add_option("--optimizer", m.optimizer, "adam (the default), sgd (momentum) or plain");
  cmd.add_flag_callback("--recompute", [&m] { m.recompute = 1; }, "full activation recomputation (the gpt presets' default)");
  cmd.add_flag_callback("--no-recompute", [&m] { m.recompute = 0; }, "no activation recomputation");
}

int plan_collective(const PlanFlags& f) {
  auto coll = collectives::parse_coll(f.collective);
  if (!coll || (*coll != collectives::Coll::Allreduce && *coll != collectives::Coll::Allgather &&
                *coll != collectives::Coll::ReduceScatter && *coll != collectives::Coll::Broadcast))
    throw InvalidArgument(fmt::format("--collective {}: the model knows allreduce, allgather, reduce_scatter and broadcast",
                                      f.collective));
  if (f.transport != "shm" && f.transport != "tcp")
    throw InvalidArgument(fmt::format("--transport {}: shm or tcp (between the ranks of one host)", f.transport));
  plan::CostTable table = load_costs(f);
  const plan::ClusterSpec cluster = plan::resolve_cluster(f.cluster);
  plan::apply_datasheet(table, cluster);
  plan::GroupShape g = plan::group_shape(cluster);
  if (f.transport == "tcp") g.local = plan::LinkClass::TcpLocal;
  if (f.csv) std::printf("collective,hosts,ranks_per_host,bytes,predicted_us,algorithm\n");
  else
    std::printf("# %s on %d host(s) x %d rank(s), %s\n#%11s  %12s  %s\n", f.collective.c_str(), g.hosts, g.ranks_per_host,
                table.source.c_str(), "size (B)", "time (us)", "algorithm (phases)");
  for (const double bytes : parse_size_list(f.sizes)) {
    const plan::Prediction p = plan::predict_collective(table, *coll, bytes, g, collectives::thresholds_from_env());
    if (f.csv)
      std::printf("%s,%d,%d,%.0f,%.3f,%s\n", f.collective.c_str(), g.hosts, g.ranks_per_host, bytes, p.us,
                  collectives::algo_name(p.algo));
    else std::printf("%12.0f  %12.2f  %s\n", bytes, p.us, p.how.c_str());
  }
  return 0;
}

int plan_layouts(const PlanFlags& f) {
  plan::CostTable table = load_costs(f);
  const plan::ModelSpec model = plan::model_spec(f.model);
  const plan::ClusterSpec cluster = plan::cluster_spec(f.cluster);
  plan::apply_datasheet(table, cluster);
  const plan::PlanResult r = plan::plan_layouts(model, cluster, table);
  std::fputs(plan::format_plan(model, cluster, r, f.top, f.csv).c_str(), stdout);
  return 0;
}

// The flags only one of the two modes reads, refused in the other by name
// (a flag that silently does nothing reads as though it had been applied).
void check_mode_flags(const CLI::App& cmd, bool collective) {
  static const std::vector<std::string> kLayoutOnly = {
      "--model", "--params", "--layers", "--hidden", "--heads", "--seq", "--vocab", "--flops-per-sample",
      "--activation-bytes", "--sample-ms", "--global-batch", "--micro-batch", "--precision", "--optimizer",
      "--recompute", "--no-recompute", "--top", "--device-memory-gb", "--device-tflops", "--memory-gbs", "--mfu"};
  static const std::vector<std::string> kCollectiveOnly = {"--sizes", "--transport"};
  if (collective) {
    for (const auto& flag : kLayoutOnly)
      if (cmd.count(flag) > 0)
        throw InvalidArgument(fmt::format(
            "cohort plan: {} describes the model or the devices' compute for planning layouts, but --collective "
            "predicts one collective's times and would ignore it. HINT: drop {}, or drop --collective to plan "
            "the model's layouts",
            flag, flag));
    return;
  }
  for (const auto& flag : kCollectiveOnly)
    if (cmd.count(flag) > 0)
      throw InvalidArgument(fmt::format("cohort plan: {} is for --collective (one collective's predicted times); "
                                        "planning a model's layouts would ignore it. HINT: add --collective allreduce "
                                        "(or allgather, reduce_scatter, broadcast), or drop {}",
                                        flag, flag));
}

}  // namespace

void add_plan_command(CLI::App& app, int& exit_code) {
  static PlanFlags f;
  auto* cmd = app.add_subcommand(
      "plan", "predict collective times, and the step time and memory of DP, ZeRO and TP x PP x DP layouts, from the "
              "cost model (docs/planning.md)");
  cmd->add_option("--calibration", f.calibration, "the file `cohort bench --calibrate FILE` wrote");
  cmd->add_option("--collective", f.collective, "predict this collective (allreduce, allgather, reduce_scatter, broadcast) "
                                                "per size instead of planning a model");
  cmd->add_option("--sizes", f.sizes, "with --collective: comma list of nccl-tests sizes (e.g. 8,1K,1M,64M)");
  cmd->add_flag("--csv", f.csv, "print CSV");
  cmd->add_flag("--same-machine", f.cluster.spec.same_machine,
                "the hosts are network namespaces of one machine: every rank shares its cores (as when calibrated so)");
  cmd->add_option("--transport", f.transport, "with --collective, between the ranks of one host: shm (default) or tcp");
  add_cluster_options(*cmd, f.cluster);
  add_model_options(*cmd, f.model);
  cmd->add_option("--top", f.top, "print this many layouts (best first)")->check(finite_above(0));
  cmd->callback([&exit_code, cmd] {
    check_mode_flags(*cmd, !f.collective.empty());
    exit_code = f.collective.empty() ? plan_layouts(f) : plan_collective(f);
  });
}

}  // namespace cohort::tools
