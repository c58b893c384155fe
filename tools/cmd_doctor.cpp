// `cohort doctor`: checks a job's environment, the connectivity between every
// pair of ranks, and measures latency and bandwidth per link class, then prints
// a verdict with a hint for each problem (src/launch/doctor.hpp). Run it as the
// workers of a job:
//   cohort run --nproc-per-node 2 cohort doctor
//   cohort run --nnodes 2 --node-rank R --master-addr HOST --nproc-per-node 8 cohort doctor --min-busbw 5
// or let `cohort run --preflight` run it before the program.
#include <chrono>

#include "cohort/error.hpp"
#include "commands.hpp"
#include "core/env.hpp"
#include "launch/doctor.hpp"

namespace cohort::tools {

void add_doctor_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("doctor", "check a job's environment, connectivity and bandwidth (run it under "
                                           "`cohort run`, like a program)");
  cmd->footer("\nRun as the workers of a job: `cohort run --nproc-per-node 2 cohort doctor`. Rank 0 prints the "
              "verdict;\nevery rank exits 0 when the job is healthy and 1 when not. See docs/observability.md.");
  static double min_busbw = 0, timeout_s = 60;
  static std::string bytes = "4M";
  static int iters = 5;
  cmd->add_option("--min-busbw", min_busbw, "GB/s every link class must reach (0: no threshold)")->capture_default_str();
  cmd->add_option("--bytes", bytes, "message size of the bandwidth probes and the allreduce (e.g. 4M)")
      ->capture_default_str();
  cmd->add_option("--iters", iters, "timed round trips per probe")->capture_default_str();
  cmd->add_option("--timeout", timeout_s, "seconds any rank waits for the others")->capture_default_str();
  cmd->callback([&exit_code] {
    launch::DoctorOptions o;
    auto b = core::parse_bytes(bytes);
    if (!b || *b == 0) throw InvalidArgument("cohort doctor --bytes " + bytes + ": expected a size like 65536, 64K or 4M");
    if (iters < 1) throw InvalidArgument("cohort doctor --iters: expected at least 1");
    if (!(min_busbw >= 0)) throw InvalidArgument("cohort doctor --min-busbw: expected GB/s, 0 or more");
    if (!(timeout_s > 0)) throw InvalidArgument("cohort doctor --timeout: expected seconds, more than 0");
    o.min_busbw_gbps = min_busbw;
    o.probe_bytes = *b;
    o.iters = iters;
    o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
    exit_code = launch::run_doctor(o);
  });
}

}  // namespace cohort::tools
