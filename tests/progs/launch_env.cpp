// Test helper for launcher_test: prints the launcher's environment contract and
// its own arguments, one "KEY=VALUE" / "ARG<i>=<arg>" line each, on stdout.
#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  const char* names[] = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                         "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                         "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
                         "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS", "COHORT_STORE_ADDR", "COHORT_STORE_PORT",
                         "COHORT_RUN_ID", "COHORT_SECRET", "GLIBC_TUNABLES"};
  for (const char* n : names) {
    const char* v = std::getenv(n);
    std::printf("%s=%s\n", n, v != nullptr ? v : "<unset>");
  }
  for (int i = 1; i < argc; ++i) std::printf("ARG%d=%s\n", i, argv[i]);
  return 0;
}
