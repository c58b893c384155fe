// cohort: one binary, subcommands like git (run, bench, env, topo, ...).
#include <cstdio>
#include <exception>
#include <string>

#include "cohort/error.hpp"
#include "cohort/process_group.hpp"
#include "commands.hpp"

int main(int argc, char** argv) {
  CLI::App app{"cohort: distributed training runtime (collectives, launcher, benchmarks)", "cohort"};
  app.set_version_flag("--version", std::string("cohort ") + cohort::version());
  app.require_subcommand(1);
  int exit_code = 0;
  cohort::tools::add_run_command(app, exit_code);
  cohort::tools::add_bench_command(app, exit_code);
  cohort::tools::add_env_command(app, exit_code);
  cohort::tools::add_topo_command(app, exit_code);
  cohort::tools::add_doctor_command(app, exit_code);
  cohort::tools::add_trace_command(app, exit_code);
  cohort::tools::add_plan_command(app, exit_code);
  // A first word that is no command (`cohort bogus`): CLI11 would only say
  // that a subcommand is required.
  if (argc > 1 && argv[1][0] != '-') {
    const std::string word = argv[1];
    std::string names;
    bool known = false;
    for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
      known = known || sub->check_name(word);
      names += (names.empty() ? "" : ", ") + sub->get_name();
    }
    if (!known) {
      std::fprintf(stderr, "cohort: error: '%s' is not a cohort command; the commands are %s (cohort --help)\n",
                   word.c_str(), names.c_str());
      return 1;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const cohort::Error& e) {
    std::fprintf(stderr, "cohort: error: %s\n", e.what());
    return 1;
  }
  return exit_code;
}
