// The `cohort` CLI's subcommands. Each file tools/cmd_NAME.cpp adds one; its
// callback does the work and stores the process exit code in `exit_code`.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace cohort::tools {

void add_run_command(CLI::App& app, int& exit_code);    // cmd_run.cpp: the launcher
void add_bench_command(CLI::App& app, int& exit_code);  // cmd_bench.cpp: nccl-tests style benchmark
void add_env_command(CLI::App& app, int& exit_code);    // cmd_env.cpp: every COHORT_* knob
void add_topo_command(CLI::App& app, int& exit_code);   // cmd_topo.cpp: hwloc topology and relation matrix
void add_doctor_command(CLI::App& app, int& exit_code);  // cmd_doctor.cpp: environment, connectivity, bandwidth check
void add_trace_command(CLI::App& app, int& exit_code);   // cmd_trace.cpp: merge and summarise timelines
void add_plan_command(CLI::App& app, int& exit_code);    // cmd_plan.cpp: the cost model and layout planner

// --sizes: a comma list of byte sizes ("8,1K,1M,64M"); InvalidArgument naming
// the item that is not one (cmd_bench.cpp and cmd_plan.cpp share the flag).
std::vector<uint64_t> parse_size_list(const std::string& list);

}  // namespace cohort::tools
