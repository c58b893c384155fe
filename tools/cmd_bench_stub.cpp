// TEMPORARY (branch launch only): `cohort bench` is written on main; this stub
// lets the launch branch link the cohort binary. Drop it when merging.
#include "commands.hpp"

namespace cohort::tools {

void add_bench_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("bench", "nccl-tests style benchmark (not on this branch)");
  cmd->allow_extras();
  cmd->callback([&exit_code] { exit_code = 1; });
}

}  // namespace cohort::tools
