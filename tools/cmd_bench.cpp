// `cohort bench COLL`: an nccl-tests style benchmark of one collective, run
// under `cohort run` (every rank runs it). Flags and columns follow
// nccl-tests: size count type redop root time algbw busbw #wrong, out-of-place
// then in-place; busbw factors from nccl-tests' PERFORMANCE.md.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "bench_calibrate.hpp"
#include "bench_colls.hpp"
#include "bench_memory.hpp"
#include "commands.hpp"
#include "core/env.hpp"
#include "svg_plot.hpp"

namespace cohort::tools {
namespace {

struct BenchFlags {
  std::string coll;
  std::string min_bytes = "8", max_bytes = "64M", sizes;
  double factor = 2;
  int iters = 20, warmup = 5, check = 1, root = 0;
  std::string dtype = "float", op = "sum";
  std::string device = "cpu";
  bool shared_buffers = false;
  std::string plot, plot_peers;  // --plot FILE.svg, --plot-peers FILE.csv
};

}  // namespace

std::vector<uint64_t> parse_size_list(const std::string& list) {
  std::vector<uint64_t> out;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    auto b = core::parse_bytes(item);
    if (!b) throw InvalidArgument(fmt::format("--sizes: '{}' is not a byte size (use e.g. 8,1K,1M,64M)", item));
    out.push_back(*b);
  }
  return out;
}

namespace {

std::vector<size_t> size_list(const BenchFlags& f) {
  std::vector<size_t> out;
  if (!f.sizes.empty()) {
    for (const uint64_t b : parse_size_list(f.sizes)) out.push_back(static_cast<size_t>(b));
    return out;
  }
  auto lo = core::parse_bytes(f.min_bytes), hi = core::parse_bytes(f.max_bytes);
  if (!lo || !hi || *lo > *hi)
    throw InvalidArgument(fmt::format("-b {} -e {}: need two byte sizes with -b <= -e (e.g. -b 8 -e 64M)", f.min_bytes, f.max_bytes));
  if (*lo == 0)
    throw InvalidArgument(fmt::format("-b {}: the smallest size must be at least 1 byte (e.g. -b 8); a size of 0 "
                                      "never grows by -f",
                                      f.min_bytes));
  if (!(f.factor > 1) || !std::isfinite(f.factor))
    throw InvalidArgument(fmt::format("-f {}: the step factor must be a finite number > 1 (e.g. -f 2)", f.factor));
  if (std::log(double(*hi) / double(*lo)) / std::log(f.factor) > 10000)
    throw InvalidArgument(fmt::format("-b {} -e {} -f {}: more than 10000 sizes; use a larger -f (e.g. 2) or --sizes",
                                      f.min_bytes, f.max_bytes, f.factor));
  for (double s = double(*lo); s <= double(*hi) * 1.0000001; s *= f.factor)
    if (out.empty() || size_t(s) != out.back()) out.push_back(size_t(s));  // a factor near 1 repeats sizes
  return out;
}

// "name,size_bytes,busbw_gbps" lines (a header line and '#' comments are skipped), one curve per name.
std::vector<svg::Series> read_peer_curves(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw InvalidArgument(fmt::format("--plot-peers {}: cannot read the file", path));
  std::vector<svg::Series> out;
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty() || line[0] == '#' || line.rfind("name,", 0) == 0) continue;
    std::stringstream ss(line);
    std::string name, size, bw;
    std::getline(ss, name, ',');
    std::getline(ss, size, ',');
    std::getline(ss, bw, ',');
    char* e1 = nullptr;
    char* e2 = nullptr;
    const double sz = std::strtod(size.c_str(), &e1), b = std::strtod(bw.c_str(), &e2);
    if (name.empty() || size.empty() || bw.empty() || *e1 != '\0' || *e2 != '\0')
      throw InvalidArgument(
          fmt::format("--plot-peers {} line {}: '{}' is not 'name,size_bytes,busbw_gbps'", path, lineno, line));
    auto it = std::find_if(out.begin(), out.end(), [&](const svg::Series& s) { return s.name == name; });
    if (it == out.end()) it = out.insert(out.end(), svg::Series{name, {}, {}});
    it->x.push_back(sz);
    it->y.push_back(b);
  }
  return out;
}

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Rank 0 prints; the others stay quiet (their numbers are folded into rank 0's).
void say(ProcessGroup& pg, const std::string& s) {
  if (pg.rank() == 0) {
    std::fputs(s.c_str(), stdout);
    std::fflush(stdout);
  }
}

void print_header(ProcessGroup& pg, BenchMemory& mem, const BenchFlags& f, const std::vector<size_t>& sizes) {
  char host[64] = {0};
  gethostname(host, sizeof(host) - 1);
  std::string me = fmt::format("#  Rank {:3d} Pid {:7d} on {:>16}", pg.rank(), getpid(), host);
  std::vector<char> line(96, 0), all(96 * pg.size(), 0);
  std::memcpy(line.data(), me.data(), std::min(me.size(), line.size() - 1));
  mem.exchange(line.data(), line.size(), all.data(), all.size(), [&](void* in, void* out) {
    return pg.allgather(Buffer{in, line.size(), DType::U8}, Buffer{out, all.size(), DType::U8});
  });
  say(pg, fmt::format("# cohort bench {}: nranks {} minBytes {} maxBytes {} warmup iters: {} iters: {} validation: {} device: {}{} "
                      "backend: {}\n#\n",
                      f.coll, pg.size(), sizes.front(), sizes.back(), f.warmup, f.iters == 0 ? std::string("auto") : std::to_string(f.iters),
                      f.check, f.device, f.shared_buffers ? " (shared buffers)" : "", pg.backend_name()));
  for (int r = 0; r < pg.size(); ++r) say(pg, std::string(all.data() + r * 96) + "\n");
  say(pg, "#\n");
  say(pg, fmt::format("#{:>79}{:>36}\n", "out-of-place", "in-place"));
  say(pg, fmt::format("#{:>11}  {:>12}  {:>8}  {:>6}  {:>6}  {:>9}  {:>7}  {:>7}  {:>6}  {:>9}  {:>7}  {:>7}  {:>6}\n", "size", "count",
                      "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong"));
  say(pg, fmt::format("#{:>11}  {:>12}  {:>8}  {:>6}  {:>6}  {:>9}  {:>7}  {:>7}  {:>6}  {:>9}  {:>7}  {:>7}  {:>6}\n", "(B)",
                      "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", ""));
}

// A size under one element (per rank, for the collectives that split it)
// would measure a collective of nothing: such sizes are left out (`lead`
// says so), and a list of only such sizes is refused.
void drop_empty_sizes(std::vector<size_t>& sizes, const BenchColl& coll, DType dt, int n, bool lead) {
  const size_t es = dtype_size(dt);
  const auto moves_nothing = [&](size_t bytes) {
    size_t sc = 0, rc = 0;
    coll.counts(bytes / es, n, sc, rc);
    return std::max(sc, rc) == 0;
  };
  const size_t before = sizes.size();
  std::erase_if(sizes, moves_nothing);
  if (sizes.empty())
    throw InvalidArgument(fmt::format("{} of {} at {} rank(s): every size is under one element ({} bytes) per rank, "
                                      "so nothing would move; HINT: raise -b/-e (or --sizes) to at least {} bytes",
                                      coll.name, dtype_name(dt), n, es, es * static_cast<size_t>(n)));
  if (sizes.size() < before && lead)
    std::printf("# %zu size(s) under one %s element per rank left out\n", before - sizes.size(),
                std::string(dtype_name(dt)).c_str());
}

int run_bench(const BenchFlags& f) {
  const BenchColl* coll = find_bench_coll(f.coll);
  if (coll == nullptr) {
    std::string names;
    for (auto& n : bench_coll_names()) names += " " + n;
    throw InvalidArgument(fmt::format("unknown collective '{}'; choose one of:{}", f.coll, names));
  }
  auto dt = parse_dtype(f.dtype);
  if (!dt) throw InvalidArgument(fmt::format("-d {}: unknown dtype; use float, double, half, bf16, int8, uint8, int32, int64", f.dtype));
  auto op = parse_reduce_op(f.op);
  if (!op) throw InvalidArgument(fmt::format("-o {}: unknown op; use sum, prod, min, max or avg", f.op));
  auto sizes = size_list(f);
  const BenchDevice device = parse_bench_device(f.device);  // cuda in a CPU-only build fails here, before any set-up

  InitOptions io;
  if (device == BenchDevice::Cuda) {
    const char* env = std::getenv("COHORT_BACKEND");
    if (env != nullptr && *env != '\0' && std::string(env) != "nccl")
      throw InvalidArgument(fmt::format("--device cuda needs the nccl backend, but COHORT_BACKEND={}; unset it or set it to nccl", env));
    io.backend = "nccl";
  }
  auto pg = init_process_group(io);
  if (device == BenchDevice::Cpu && pg->backend_name() == "nccl")
    throw InvalidArgument("the nccl backend moves GPU memory only: add --device cuda (or use COHORT_BACKEND=native)");
  const int n = pg->size();
  if (f.root < 0 || f.root >= n) throw InvalidArgument(fmt::format("-r {}: root out of range 0..{}", f.root, n - 1));
  const size_t es = dtype_size(*dt);
  drop_empty_sizes(sizes, *coll, *dt, n, pg->rank() == 0);
  size_t max_send = 0, max_recv = 0;
  for (size_t s : sizes) {
    size_t sc, rc;
    coll->counts(s / es, n, sc, rc);
    max_send = std::max(max_send, sc);
    max_recv = std::max(max_recv, rc);
  }
  auto mem = BenchMemory::make(device, max_send * es + 64, max_recv * es + 64, f.shared_buffers ? pg.get() : nullptr);
  print_header(*pg, *mem, f, sizes);
  // One control allreduce of a single element (timings, wrong counts), through the backend's memory.
  auto allreduce_one = [&](void* v, DType t) {
    mem->exchange(v, dtype_size(t), v, dtype_size(t), [&](void* in, void* out) {
      return pg->allreduce(Buffer{in, 1, t}, Buffer{out, 1, t});
    });
  };

  if (!f.plot_peers.empty() && f.plot.empty())
    throw InvalidArgument("--plot-peers adds curves to the --plot picture: add --plot FILE.svg");
  const std::vector<svg::Series> peers =
      f.plot_peers.empty() ? std::vector<svg::Series>{} : read_peer_curves(f.plot_peers);
  svg::Series oop{fmt::format("cohort {}", pg->backend_name()), {}, {}}, ip{"cohort in-place", {}, {}};
  double bw_sum = 0;
  int bw_rows = 0;
  int64_t total_wrong = 0;
  for (size_t size : sizes) {
    size_t sc, rc;
    coll->counts(size / es, n, sc, rc);
    const size_t count = std::max(sc, rc);  // the larger side, as nccl-tests reports size and count
    const size_t bytes = count * es;
    std::string row = fmt::format("{:>12}  {:>12}  {:>8}  {:>6}  {:>6}", bytes, count, dtype_name(*dt),
                                  coll->reduces ? std::string(reduce_op_name(*op)) : "none", coll->rooted ? f.root : -1);
    const int iters = f.iters > 0 ? f.iters : int(std::clamp<size_t>((size_t(2) << 30) / std::max<size_t>(bytes, 1), 5, 1000));
    for (int in_place = 0; in_place < 2; ++in_place) {
      BenchCase c{coll, *dt, *op, f.root, in_place == 1};
      // The patterns live in the host buffers; the collective runs on send/recv (the same, or their GPU twins).
      Buffer host_send{mem->host_send(), sc, *dt}, host_recv{mem->host_recv(), rc, *dt};
      Buffer send{mem->send(), sc, *dt}, recv{mem->recv(), rc, *dt};
      fill_inputs(*pg, c, host_send, host_recv);
      mem->upload(host_send.bytes(), host_recv.bytes());
      for (int i = 0; i < f.warmup; ++i) run_once(*pg, c, send, recv)->wait();
      pg->barrier()->wait();
      double t0 = now_us();
      if (device == BenchDevice::Cuda) {
        // As nccl-tests: enqueue every iteration on the stream, then wait (host
        // timer after the last one's event has completed).
        std::vector<WorkPtr> works;
        for (int i = 0; i < iters; ++i) works.push_back(run_once(*pg, c, send, recv));
        for (auto& w : works) w->wait();
      } else {
        for (int i = 0; i < iters; ++i) run_once(*pg, c, send, recv)->wait();
      }
      double us = (now_us() - t0) / iters;
      double sum_us = us;
      allreduce_one(&sum_us, DType::F64);
      us = sum_us / n;
      int64_t wrong = 0;
      if (f.check) {
        fill_inputs(*pg, c, host_send, host_recv);
        mem->upload(host_send.bytes(), host_recv.bytes());
        run_once(*pg, c, send, recv)->wait();
        mem->download(host_send.bytes(), host_recv.bytes());
        wrong = count_wrong(*pg, c, host_send, host_recv);
        allreduce_one(&wrong, DType::I64);
        total_wrong += wrong;
      }
      double algbw = bytes / us / 1e3;  // GB/s with 1 GB = 1e9 B
      double busbw = algbw * coll->factor(n);
      bw_sum += busbw;
      ++bw_rows;
      (in_place ? ip : oop).x.push_back(double(bytes));
      (in_place ? ip : oop).y.push_back(busbw);
      row += fmt::format("  {:>9.2f}  {:>7.2f}  {:>7.2f}  {:>6}", us, algbw, busbw, f.check ? std::to_string(wrong) : "N/A");
    }
    say(*pg, row + "\n");
  }
  say(*pg, fmt::format("# Out of bounds values : {} {}\n", total_wrong, total_wrong == 0 ? "OK" : "FAILED"));
  say(*pg, fmt::format("# Avg bus bandwidth    : {:.4f}\n#\n", bw_rows ? bw_sum / bw_rows : 0.0));
  if (!f.plot.empty() && pg->rank() == 0) {
    svg::LineChart c{fmt::format("{} busbw, {} ranks, {} {}", f.coll, n, f.dtype, coll->reduces ? f.op : std::string()),
                     "message size (bytes)",
                     "busbw (GB/s)",
                     true,
                     {oop, ip}};
    c.series.insert(c.series.end(), peers.begin(), peers.end());
    svg::write_file(f.plot, svg::render(c));
    say(*pg, fmt::format("# plot: {}\n", f.plot));
  }
  pg->shutdown();
  return total_wrong == 0 ? 0 : 1;
}

}  // namespace

void add_bench_command(CLI::App& app, int& exit_code) {
  static BenchFlags f;
  static CalibrateFlags cal;
  auto* cmd = app.add_subcommand("bench", "nccl-tests style benchmark of one collective; run it under `cohort run`");
  cmd->add_option("collective", f.coll, "allreduce, broadcast, reduce, allgather, reduce_scatter, alltoall, gather, scatter, sendrecv");
  cmd->add_option("--calibrate", cal.file,
                  "instead of one collective: measure allreduce, allgather, reduce_scatter and broadcast from 8 B to -e "
                  "on this group and merge the samples into FILE for `cohort plan` (docs/planning.md)");
  cmd->add_flag("--same-machine", cal.same_machine,
                "with --calibrate across hosts: the hosts are network namespaces of this machine, so every rank shares "
                "its cores");
  cmd->add_option("-b,--minbytes", f.min_bytes, "smallest size (e.g. 8, 1K, 1M)");
  cmd->add_option("-e,--maxbytes", f.max_bytes, "largest size");
  cmd->add_option("-f,--stepfactor", f.factor, "multiply the size by this between rows");
  cmd->add_option("--sizes", f.sizes, "explicit comma list of sizes instead of -b/-e/-f (e.g. 8,1K,1M,64M)");
  cmd->add_option("-n,--iters", f.iters, "timed iterations per size (0: clamp(2 GiB / size, 5, 1000), as the peer scripts)")
      ->check(CLI::Range(0, 1 << 30));
  cmd->add_option("-w,--warmup_iters", f.warmup, "untimed iterations first")->check(CLI::Range(0, 1 << 30));
  cmd->add_option("-c,--check", f.check, "1: check every element of the result after the timed loop")
      ->check(CLI::IsMember({0, 1}));
  cmd->add_option("-d,--datatype", f.dtype, "float, double, half, bf16, int8, uint8, int32, int64");
  cmd->add_option("-o,--op", f.op, "sum, prod, min, max, avg");
  cmd->add_option("-r,--root", f.root, "root rank of rooted collectives");
  cmd->add_option("--plot", f.plot, "rank 0 draws busbw against size into this SVG file");
  cmd->add_option(
      "--plot-peers", f.plot_peers,
      "CSV of other curves for --plot, lines 'name,size_bytes,busbw_gbps' (bench/compare_peers.py --plot writes it)");
  cmd->add_option("--device", f.device,
                  "cpu: host buffers (native backend); cuda: GPU buffers with the nccl backend (a build with CUDA, docs/nccl.md)");
  cmd->add_flag("--shared-buffers", f.shared_buffers,
               "allocate the buffers with ProcessGroup::allocate_buffer, as DDP's gradient buckets are: peers on one host "
               "then map them and single-copy allreduces (one host, or each host's phases of the node-aware one) "
               "load and store them directly (like nccl-tests -R)");
  cmd->callback([&exit_code] {
    if (!cal.file.empty()) {
      if (!f.coll.empty())
        throw InvalidArgument(fmt::format("--calibrate measures every collective it needs: drop '{}'", f.coll));
      if (f.device != "cpu" || f.shared_buffers)
        throw InvalidArgument("--calibrate measures cohort's native collectives on ordinary host buffers; calibrating "
                              "NCCL (--device cuda) or shared buffers is not written yet (docs/planning.md, \"Limits\")");
      cal.max_bytes = f.max_bytes;
      exit_code = run_calibrate(cal);
      return;
    }
    if (f.coll.empty()) throw InvalidArgument("name a collective (e.g. `cohort bench allreduce`) or give --calibrate FILE");
    exit_code = run_bench(f);
  });
}

}  // namespace cohort::tools
