// The `cohort` CLI's subcommands. Each file tools/cmd_NAME.cpp adds one; its
// callback does the work and stores the process exit code in `exit_code`.
#pragma once

#include <CLI/CLI.hpp>

namespace cohort::tools {

void add_run_command(CLI::App& app, int& exit_code);    // cmd_run.cpp: the launcher
void add_bench_command(CLI::App& app, int& exit_code);  // cmd_bench.cpp: nccl-tests style benchmark
void add_env_command(CLI::App& app, int& exit_code);    // cmd_env.cpp: every COHORT_* knob
void add_topo_command(CLI::App& app, int& exit_code);   // cmd_topo.cpp: hwloc topology and relation matrix
void add_doctor_command(CLI::App& app, int& exit_code);  // cmd_doctor.cpp: environment, connectivity, bandwidth check
void add_trace_command(CLI::App& app, int& exit_code);   // cmd_trace.cpp: merge and summarise timelines
void add_plan_command(CLI::App& app, int& exit_code);    // cmd_plan.cpp: the cost model and layout planner

}  // namespace cohort::tools
