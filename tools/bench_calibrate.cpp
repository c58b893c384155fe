// `cohort bench --calibrate FILE`: measures allreduce, allgather,
// reduce_scatter and broadcast from 8 B to 64 MiB (by factors of 2) on the group it runs in,
// records which algorithm the tuner ran for each, and merges the samples into
// the calibration file that `cohort plan` reads (docs/planning.md). The link
// class comes from the group: one host over shared memory (shm), one host
// over TCP (tcp_local, COHORT_TRANSPORT=tcp), or one rank on each of several
// hosts (tcp_cross).
#include "bench_calibrate.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <vector>

#include "bench_colls.hpp"
#include "collectives/tuner.hpp"
#include "core/cpu_list.hpp"
#include "core/env.hpp"
#include "group/native_group.hpp"
#include "plan/calibration.hpp"
#include "plan/collective_time.hpp"

namespace cohort::tools {
namespace {

namespace c = collectives;

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The CPUs the ranks on one machine share: the union of their affinities
// (a collective), not this rank's own, which `cohort run --bind auto`
// narrows to one core per rank (2 ranks on 2 cores would record 1). Across
// hosts (one rank per host) a rank's own. CPUs numbered past 1023 count as
// online CPUs.
int machine_cores(ProcessGroup& pg, bool one_machine) {
  const core::CpuList mine = core::current_affinity();
  const int online = int(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
  if (mine.empty() || mine.back() >= 1024) return online;
  if (!one_machine) return int(mine.size());
  constexpr size_t kWords = 1024 / 64;
  std::vector<uint64_t> bits(kWords, 0), all(kWords * size_t(pg.size()), 0);
  for (const int cpu : mine) bits[size_t(cpu) / 64] |= uint64_t(1) << (cpu % 64);
  pg.allgather(Buffer{bits.data(), kWords, DType::I64}, Buffer{all.data(), all.size(), DType::I64})->wait();
  for (size_t i = kWords; i < all.size(); ++i) all[i % kWords] |= all[i];
  int count = 0;
  for (size_t w = 0; w < kWords; ++w) count += __builtin_popcountll(all[w]);
  return count > 0 ? count : online;
}

plan::LinkClass class_of(const c::TunerInput& in, int nranks) {
  if (in.hosts > 1) {
    if (in.hosts != nranks)
      throw InvalidArgument(fmt::format(
          "--calibrate across hosts measures the link between them, so it needs one rank per host, and this group "
          "has {} ranks on {} hosts; run `cohort run --nproc-per-node 1` on each host (the ranks that share a host "
          "are the shm class: calibrate it with all ranks on one host)",
          nranks, in.hosts));
    return plan::LinkClass::TcpCross;
  }
  return in.all_shm ? plan::LinkClass::Shm : plan::LinkClass::TcpLocal;
}

std::vector<size_t> calibration_sizes(size_t max_bytes) {
  std::vector<size_t> out;
  for (size_t s = 8; s <= max_bytes; s *= 2) out.push_back(s);  // 3 or more sizes in every band of the fit
  if (out.empty() || out.back() != max_bytes) out.push_back(max_bytes);
  return out;
}

// The mean time of one call, as the median of 5 timed blocks (all ranks
// agree: each block starts after a barrier, and the slowest rank's counts).
// Each block has buffers of its own, at another offset in a fresh
// allocation: on this VM the same call runs up to 7x faster or slower for the
// whole life of a process depending on where its buffers lie, and the median
// of several placements is what a program sees most often.
double time_calls(ProcessGroup& pg, const BenchCase& bc, size_t send_count, size_t recv_count, int iters) {
  std::vector<double> blocks;
  for (int b = 0; b < 5; ++b) {
    const size_t skew = size_t(b) * 1040;  // floats: 4160 bytes, past the page and cache-set aliasing
    std::vector<float> sv(send_count + skew + 16), rv(recv_count + skew + 16);
    Buffer send{sv.data() + skew, send_count, DType::F32}, recv{rv.data() + skew, recv_count, DType::F32};
    for (int i = 0; i < 2; ++i) run_once(pg, bc, send, recv)->wait();
    pg.barrier()->wait();
    const double t0 = now_us();
    for (int i = 0; i < iters; ++i) run_once(pg, bc, send, recv)->wait();
    double us = (now_us() - t0) / iters;
    pg.allreduce(Buffer{&us, 1, DType::F64}, Buffer{&us, 1, DType::F64}, AllreduceOptions{ReduceOp::Max})->wait();
    blocks.push_back(us);
  }
  std::sort(blocks.begin(), blocks.end());
  return blocks[2];
}

// Before measuring: a file that is there but cannot take the samples (another
// version, damaged), or a directory where none can be written, stops the run
// now rather than after minutes of measuring.
void check_target(const std::string& file) {
  namespace fs = std::filesystem;
  if (fs::exists(file)) {
    try {
      plan::read_calibration(file, COHORT_VERSION);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format("--calibrate {}: the file exists and this run's samples cannot be merged into "
                                        "it: {}. HINT: move the file aside (or delete it) to start a new one, or name "
                                        "another file",
                                        file, e.what()));
    }
  }
  std::error_code ec;
  const fs::path dir = fs::absolute(fs::path(file), ec).parent_path();
  if (ec || !fs::is_directory(dir, ec) || access(dir.c_str(), W_OK) != 0)
    throw InvalidArgument(fmt::format("--calibrate {}: cannot write the file: {} is not a directory this process may "
                                      "write. HINT: create the directory, or name a file elsewhere",
                                      file, dir.string()));
}

}  // namespace

int run_calibrate(const CalibrateFlags& f) {
  auto max_bytes = core::parse_bytes(f.max_bytes);
  if (!max_bytes || *max_bytes < 8)
    throw InvalidArgument(fmt::format("-e {}: the largest size must be a byte size of at least 8 (e.g. 64M)", f.max_bytes));
  // Rank 0 writes the file, so only it checks where (another host's ranks
  // may not see that directory); if it refuses, the launcher stops the rest.
  if (const char* rank = std::getenv("RANK"); rank == nullptr || std::string(rank) == "0") check_target(f.file);
  auto pg = init_process_group();
  auto* native = dynamic_cast<group::NativeGroup*>(pg.get());
  if (native == nullptr)
    throw InvalidArgument(fmt::format("--calibrate measures cohort's own collectives, and this group runs the {} backend; "
                                      "unset COHORT_BACKEND",
                                      pg->backend_name()));
  const int n = pg->size();
  if (n < 2) throw InvalidArgument("--calibrate needs 2 or more ranks: run it under `cohort run --nproc-per-node 2` or more");
  const c::TunerInput shape = native->tuner_input(c::Coll::Allreduce, 0);
  const plan::LinkClass cls = class_of(shape, n);
  plan::ClassSamples fresh;
  fresh.cores = machine_cores(*pg, shape.hosts == 1 || f.same_machine);
  fresh.single_copy = shape.single_copy;
  fresh.segment = double(native->pipeline_segment());
  const int machine_ranks = f.same_machine ? n : n / shape.hosts;
  char host[64] = {0};
  gethostname(host, sizeof(host) - 1);
  const std::time_t now = std::time(nullptr);
  char when[32];
  std::strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  fresh.measured = fmt::format("{} ranks on {} ({} cores{}), {}", n, host, fresh.cores,
                               f.same_machine ? ", hosts share the machine" : "", when);

  const std::vector<size_t> sizes = calibration_sizes(*max_bytes);
  const size_t es = 4;
  const std::vector<std::string> colls = {"allreduce", "allgather", "reduce_scatter", "broadcast"};
  for (const std::string& name : colls) {
    const BenchColl* coll = find_bench_coll(name);
    const c::Coll cc = *c::parse_coll(name);
    for (size_t size : sizes) {
      size_t sc, rc;
      coll->counts(size / es, n, sc, rc);
      if (sc == 0 || rc == 0) continue;
      const double bytes = double(std::max(sc, rc) * es);  // nccl-tests' size
      const size_t tuner_bytes = cc == c::Coll::Allgather ? sc * es : size_t(bytes);
      const c::Algo algo = c::forced_algo(cc).value_or(plan::algorithm_run(native->tuner_input(cc, tuner_bytes), native->thresholds()));
      const int iters = int(std::clamp<double>(double(f.budget_bytes) / bytes, 3, 200));
      BenchCase bc{coll, DType::F32, ReduceOp::Sum, 0, false};
      const double us = time_calls(*pg, bc, sc, rc, iters);
      fresh.samples.push_back(plan::Sample{cc, algo, n, machine_ranks, bytes, us});
      if (pg->rank() == 0 && f.verbose)
        std::printf("# %-15s %-20s %12.0f B  %12.2f us\n", name.c_str(), c::algo_name(algo), bytes, us);
    }
  }
  if (pg->rank() == 0) {
    plan::Calibration cal;
    cal.cohort_version = COHORT_VERSION;
    // A file it cannot read (another version, damaged) is left alone: its other classes would be lost.
    if (std::filesystem::exists(f.file)) cal = plan::read_calibration(f.file, COHORT_VERSION);
    plan::merge_samples(cal, cls, fresh);
    plan::write_calibration(f.file, cal);
    const plan::ClassCosts costs = plan::fit_class(cal.classes[cls]);
    std::printf("# calibrated %s: %zu samples at %d ranks into %s\n", plan::link_class_name(cls), fresh.samples.size(), n,
                f.file.c_str());
    std::printf("# %-36s %10s %12s %12s %7s %8s\n", "algorithm", "alpha_us", "alpha_os_us", "GB/s(1/beta)", "points",
                "max_err");
    for (const auto& [key, fit] : costs.fits)  // "-": no per-byte term (a band of small sizes)
      std::printf("  %-36s %10.3f %12.3f %12s %7d %7.0f%%\n", key.c_str(), fit.alpha_us, fit.alpha_os_us,
                  fit.beta_us_per_byte > 0 ? fmt::format("{:.3f}", 1e-3 / fit.beta_us_per_byte).c_str() : "-",
                  fit.points, 100 * fit.max_rel_err);
    std::fflush(stdout);
  }
  pg->shutdown();
  return 0;
}

}  // namespace cohort::tools
