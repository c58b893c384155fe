#include "launch/job.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "cohort/error.hpp"
#include "core/cpu_list.hpp"
#include "core/env.hpp"
#include "launch/output.hpp"

extern char** environ;

namespace cohort::launch {
namespace {

const core::Knob kMallocTuning{"COHORT_MALLOC_TUNING", "1",
                               "cohort run: give the workers fixed glibc malloc thresholds (GLIBC_TUNABLES mmap 32 MiB, "
                               "trim 256 MiB) so that memory freed every step is not returned to the kernel and faulted "
                               "in again; 0: leave malloc alone (also left alone when GLIBC_TUNABLES or MALLOC_*_ is set)",
                               core::KnobKind::Bool};

std::string make_log_root(const LaunchOptions& opts) {
  if (!opts.log_dir.empty()) return opts.log_dir;
  bool any_file = false;
  for (int lr = 0; lr < opts.nproc_per_node; ++lr) {
    StreamRoute r = route_streams(opts, lr);
    any_file = any_file || r.file_out || r.file_err;
  }
  if (!any_file) return "";
  std::string tmpl = (std::filesystem::temp_directory_path() / "cohort_logs_XXXXXX").string();
  if (mkdtemp(tmpl.data()) == nullptr)
    throw IoError(fmt::format("cannot create a log directory {}: {}; pass --log-dir DIR", tmpl, std::strerror(errno)));
  return tmpl;
}

}  // namespace

std::string this_host() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return buf;
}

JobSetup prepare_job(const LaunchOptions& opts) {
  JobSetup job;
  const char* python = std::getenv("PYTHON_EXEC");
  job.argv = worker_argv(opts, python != nullptr && *python != '\0' ? python : "python3");
  const char* path = std::getenv("PATH");
  job.exe = resolve_program(job.argv[0], path != nullptr ? path : "/usr/bin:/bin");
  if (job.argv[0] != opts.command[0] && !opts.module && !std::filesystem::exists(opts.command[0]))
    throw InvalidArgument(
        fmt::format("script {} does not exist; check the path (or pass --no-python to run a "
                    "program of that name directly)",
                    opts.command[0]));
  job.host = this_host();
  job.set_omp = omp_threads_default_needed(std::getenv("OMP_NUM_THREADS"), opts.nproc_per_node);
  job.glibc_tunables = malloc_tunables_default(std::getenv("GLIBC_TUNABLES"), std::getenv("MALLOC_TRIM_THRESHOLD_"),
                                               std::getenv("MALLOC_MMAP_THRESHOLD_"), kMallocTuning.boolean());
  job.host_cpus = host_cpus_default(std::getenv("COHORT_HOST_CPUS"), static_cast<int>(core::current_affinity().size()));
  job.log_root = make_log_root(opts);
  job.bind_mode = parse_bind(opts.bind);
  job.bind = plan_binding_here(job.bind_mode, opts.nproc_per_node);
  return job;
}

std::vector<WorkerPlan> plan_workers(const LaunchOptions& opts, const JobSetup& job, const JobEnv& env) {
  std::vector<WorkerPlan> plans;
  for (int lr = 0; lr < opts.nproc_per_node; ++lr) {
    WorkerPlan p;
    p.local_rank = lr;
    p.global_rank = env.rank_base + lr;
    p.spawn.path = job.exe;
    p.spawn.argv = job.argv;
    if (!job.bind.cpus.empty()) p.spawn.cpus = job.bind.cpus[static_cast<size_t>(lr)];
    p.spawn.env = merge_environment(environ, worker_env_vars(env, lr));
    p.route = route_streams(opts, lr);
    if (!job.log_root.empty()) p.log_dir = worker_log_dir(job.log_root, env.cohort_run_id, env.restart_count, p.global_rank);
    plans.push_back(std::move(p));
  }
  return plans;
}

}  // namespace cohort::launch
