// `cohort env`: every COHORT_* knob with its current value, default and
// meaning; a set value that does not parse is marked INVALID (exit status 1).
#include <cstdio>
#include <string>

#include "commands.hpp"
#include "core/env.hpp"

namespace cohort::tools {

void add_env_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("env", "list every COHORT_* environment knob with its value and meaning");
  static bool markdown = false;
  cmd->add_flag("--markdown", markdown, "print a markdown table (docs/env.md is made this way)");
  cmd->callback([&exit_code] {
    auto knobs = core::all_knobs();
    if (markdown) {
      std::printf("| variable | default | meaning |\n|---|---|---|\n");
      for (const auto* k : knobs) {
        std::string d = *k->default_value() ? "`" + std::string(k->default_value()) + "`" : "(unset)";
        std::printf("| `%s` | %s | %s |\n", k->name(), d.c_str(), k->help());
      }
      exit_code = 0;
      return;
    }
    int invalid = 0;
    for (const auto* k : knobs) {
      std::string v = k->str();
      const std::string problem = k->problem();
      std::printf("%-28s = %-12s %s\n    %s\n", k->name(), v.c_str(),
                  !problem.empty() ? "(set, INVALID)" : k->is_set() ? "(set)" : "(default)", k->help());
      if (!problem.empty()) {
        std::printf("    INVALID: %s\n", problem.c_str());
        ++invalid;
      }
    }
    if (invalid > 0)
      std::fprintf(stderr, "cohort env: %d knob%s set to a value that does not parse (INVALID above)\n", invalid,
                   invalid == 1 ? "" : "s");
    exit_code = invalid > 0 ? 1 : 0;
  });
}

}  // namespace cohort::tools
