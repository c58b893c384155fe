#!/usr/bin/env python3
"""Runs cohort's benchmark and the peers' (Open MPI, PyTorch gloo) on the same
sizes, interleaved, REPS times, and prints busbw / latency side by side with
ratios (median over reps). Invoked by bench/compare_peers.sh; see
docs/performance.md for the latest table and the commands.

Rows of every program have the nccl-tests shape:
  size count type redop [root] time algbw busbw #wrong [in-place columns]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import perf_csv  # noqa: E402
SIZES = [8, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def parse_rows(text, has_root):
    """size -> (time_us, busbw, wrong) from nccl-tests style rows (out-of-place columns)."""
    out = {}
    for line in text.splitlines():
        line = re.sub(r"^\[rank\d+\]: ", "", line)  # cohort run's per-rank prefix
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        f = line.split()
        if not f[0].isdigit():
            continue
        base = 5 if has_root else 4
        try:
            out[int(f[0])] = (float(f[base]), float(f[base + 2]), f[base + 3])
        except (ValueError, IndexError):
            pass
    return out


def median_of(results, name, size, idx):
    """Median over reps of one figure (0 time_us, 1 busbw) of one configuration at one size; None if absent."""
    vals = [r[size][idx] for r in results[name] if size in r]
    return statistics.median(vals) if vals else None


# Which columns are compared with which, in this order, when both were run.
PAIRS = [("cohort shm", "mpi shm"), ("cohort shm shared", "mpi shm"), ("cohort tcp", "mpi tcp"),
         ("cohort tcp", "gloo tcp"), ("cohort shm", "gloo tcp"), ("cohort mpi", "mpi shm serialized"),
         ("cohort mpi", "mpi shm"), ("cohort mpi single", "mpi shm"),
         ("cohort hierarchical", "cohort flat ring"), ("cohort hierarchical", "gloo tcp"),
         ("cohort hierarchical shared", "cohort flat ring shared"), ("cohort hierarchical shared", "gloo tcp"),
         ("cohort shm", "cohort shm spin 30us")]


def table(results, coll, np, reps, with_gloo=True):
    """The markdown table (medians and ratios) and the lines under it, from
    results: configuration -> one {size: (time_us, busbw, wrong)} per rep."""
    names = list(results)
    pairs = [(a, b) for a, b in PAIRS if a in results and b in results and (with_gloo or "gloo" not in b)]
    out = [f"## {coll}, {np} ranks, float32 sum, median of {reps} interleaved runs\n"]
    out.append("| size | " + " | ".join(names) + "".join(f" | {a} / {b}" for a, b in pairs) + " |")
    out.append("|---" * (len(names) + len(pairs) + 1) + "|")
    for s in SIZES:
        small = s <= 1024
        idx = 0 if small else 1  # time for latency-bound sizes, busbw otherwise
        vals = {n: median_of(results, n, s, idx) for n in names}

        def ratio(a, b):
            if vals.get(a) is None or vals.get(b) is None or vals[b] == 0:
                return "-"
            # Report "x better": for times lower is better.
            r = vals[b] / vals[a] if small else vals[a] / vals[b]
            return f"{r:.2f}x"

        def cell(v):
            return "-" if v is None else (f"{v:.2f} us" if small else f"{v:.2f}")
        label = f"{s} B" if s < 1024 else (f"{s >> 10} KiB" if s < (1 << 20) else f"{s >> 20} MiB")
        unit = "us" if small else "GB/s"
        out.append(f"| {label} ({unit}) | " + " | ".join([cell(vals[n]) for n in names] + [ratio(a, b) for a, b in pairs]) + " |")
    wrong = {n: sorted({r[s][2] for r in results[n] for s in r}) for n in names}
    out.append(f"\n#wrong seen: {wrong}")
    out.append("Ratios are 'times better than the peer': time_peer / time_ours for 8 B and 1 KiB, busbw_ours / busbw_peer above.")
    # The small sizes swing between runs on a shared host: each run's figure, to judge what "within noise" is.
    for s in (s for s in SIZES if s <= 1024):
        runs = "; ".join(f"{n} " + " ".join(f"{r[s][0]:.2f}" for r in results[n] if s in r) for n in names)
        out.append(f"Each run at {s} B (us): {runs}")
    return "\n".join(out)


CSV_HEADER = "measured_utc,coll,np,config,rep,size_bytes,time_us,busbw_gbps,wrong"


def write_csv(path, results, coll, np):
    """Every rep's raw figures, one line per configuration, rep and size, stamped with the time of writing."""
    when = perf_csv.now_utc()
    perf_csv.write(path, CSV_HEADER, ([when, coll, np, name, rep + 1, size, *rows[size]]
                                      for name, reps in results.items() for rep, rows in enumerate(reps)
                                      for size in sorted(rows)))


def read_csv(path):
    """(measured_utc, coll, np, reps, results) as write_csv wrote them."""
    results, when, coll, np, reps = {}, None, None, None, 0
    for when, c, n, name, rep, size, t, bw, wrong in perf_csv.rows(path, CSV_HEADER, "compare_peers"):
        coll, np, rep = c, int(n), int(rep)
        reps = max(reps, rep)
        runs = results.setdefault(name, [])
        while len(runs) < rep:
            runs.append({})
        runs[rep - 1][int(size)] = (float(t), float(bw), wrong)
    return when, coll, np, reps, results


def run(cmd, env_extra=None, timeout=600):
    env = dict(os.environ)
    env.update(env_extra or {})
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if p.returncode != 0:
        sys.stderr.write(f"command failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout[-3000:]}\n")
    return p.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cohort", required=True, help="path of the cohort binary")
    ap.add_argument("--coll", default="allreduce")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--no-gloo", action="store_true")
    ap.add_argument("--plot", metavar="FILE.svg",
                    help="also draw busbw against size: the peers' medians go to FILE.peers.csv and one more cohort "
                         "run draws them beside its own curve (cohort bench --plot --plot-peers)")
    ap.add_argument("--with-mpi-backend", action="store_true",
                    help="also run cohort's mpi backend (COHORT_BACKEND=mpi under mpirun) next to Open MPI's own figures")
    ap.add_argument("--only-mpi", action="store_true", help="run only Open MPI shm and cohort's mpi backend (implies --with-mpi-backend)")
    ap.add_argument("--csv", metavar="FILE",
                    help="also write every rep's raw figures to FILE (bench/write_performance.py turns the CSVs in "
                         "docs/perf/ into docs/performance.md's tables)")
    ap.add_argument("--shared-buffers", action="store_true",
                    help="also run cohort over shm with its buffers from ProcessGroup::allocate_buffer (cohort bench "
                         "--shared-buffers), as DDP's buckets and sharded optimizers' flat buffers are: peers map them, "
                         "and single copy loads and stores them directly")
    ap.add_argument("--with-spin", action="store_true",
                    help="also run cohort over shm with COHORT_SPIN_US=30, the busy-poll its ranks did before they "
                         "yielded at once where they outnumber the CPUs (docs/performance.md, \"More ranks than cores\")")
    args = ap.parse_args()
    if not os.access(os.path.join(HERE, "peers/bin/mpi_allreduce"), os.X_OK):
        sys.exit("compare_peers: bench/peers/bin/mpi_allreduce is not built; run bench/compare_peers.sh (it installs the "
                 "peers and builds it) with the same arguments")

    sizes = ",".join(str(s) for s in SIZES)
    mpi_coll = {"broadcast": "bcast"}.get(args.coll, args.coll)
    top = max(SIZES)
    configs = {
        "cohort shm": lambda: parse_rows(run([args.cohort, "run", "--standalone", "--nproc-per-node", str(args.np), args.cohort, "bench", args.coll,
                                              "--sizes", sizes, "-n", "0", "-w", "5", "-c", "1"]), True),
        "mpi shm": lambda: parse_rows(run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(args.np),
                                           os.path.join(HERE, "peers/bin/mpi_allreduce"), "-c", mpi_coll, "-b", "8",
                                           "-e", str(top), "-f", "4"]), False),
        "cohort tcp": lambda: parse_rows(run([args.cohort, "run", "--standalone", "--nproc-per-node", str(args.np), args.cohort, "bench", args.coll,
                                              "--sizes", sizes, "-n", "0", "-w", "5", "-c", "1"],
                                             {"COHORT_TRANSPORT": "tcp"}), True),
        "mpi tcp": lambda: parse_rows(run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(args.np), "--mca", "btl",
                                           "tcp,self", os.path.join(HERE, "peers/bin/mpi_allreduce"), "-c", mpi_coll, "-b", "8",
                                           "-e", str(top), "-f", "4"]), False),
    }
    if args.shared_buffers:
        configs["cohort shm shared"] = lambda: parse_rows(run([args.cohort, "run", "--standalone", "--nproc-per-node", str(args.np),
                                                              args.cohort, "bench", args.coll, "--sizes", sizes, "-n", "0", "-w",
                                                              "5", "-c", "1", "--shared-buffers"]), True)
    if args.with_spin:
        configs["cohort shm spin 30us"] = lambda: parse_rows(run([args.cohort, "run", "--standalone", "--nproc-per-node",
                                                                 str(args.np), args.cohort, "bench", args.coll, "--sizes",
                                                                 sizes, "-n", "0", "-w", "5", "-c", "1"],
                                                                {"COHORT_SPIN_US": "30"}), True)
    if args.with_mpi_backend or args.only_mpi:
        # The same engine as "mpi shm", called through cohort's ProcessGroup: the difference is our call path.
        configs["cohort mpi"] = lambda: parse_rows(run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(args.np),
                                                        args.cohort, "bench", args.coll, "--sizes", sizes, "-n", "0", "-w", "5",
                                                        "-c", "1"], {"COHORT_BACKEND": "mpi"}), True)
        # The C benchmark at cohort's default thread level (MPI_THREAD_SERIALIZED; Open MPI's MPI_Init reads
        # OMPI_MPI_THREAD_LEVEL, 2 = serialized): the same engine in the same mode, so the ratio is our call path.
        configs["mpi shm serialized"] = lambda: parse_rows(run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np",
                                                                str(args.np), "-x", "OMPI_MPI_THREAD_LEVEL=2",
                                                                os.path.join(HERE, "peers/bin/mpi_allreduce"), "-c", mpi_coll,
                                                                "-b", "8", "-e", str(top), "-f", "4"]), False)
        # MPI_THREAD_SINGLE, as the C benchmark's MPI_Init: Open MPI itself is ~0.1 us slower per small call
        # at any level above single (docs/mpi.md, Threads).
        configs["cohort mpi single"] = lambda: parse_rows(run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np",
                                                               str(args.np), args.cohort, "bench", args.coll, "--sizes", sizes,
                                                               "-n", "0", "-w", "5", "-c", "1"],
                                                              {"COHORT_BACKEND": "mpi", "COHORT_MPI_THREAD_LEVEL": "single"}), True)
    if args.only_mpi:
        configs = {k: v for k, v in configs.items() if k in ("mpi shm", "mpi shm serialized", "cohort mpi", "cohort mpi single")}
        args.no_gloo = True
    if not args.no_gloo:
        configs["gloo tcp"] = lambda: parse_rows(run(["/usr/bin/python3", "-m", "torch.distributed.run", "--redirects", "9:0", "--tee",
                                                      "9:0", "--nnodes", "1", "--nproc_per_node", str(args.np), "--master_addr",
                                                      "127.0.0.1", "--master_port", "29511",
                                                      os.path.join(HERE, "peers/gloo_allreduce.py"), "-c", args.coll, "-b", "8",
                                                      "-e", str(top), "-f", "4"], {"GLOO_SOCKET_IFNAME": "lo"}), False)

    results = {k: [] for k in configs}
    for rep in range(args.reps):
        for name, fn in configs.items():  # interleaved: the host's vCPU placement drifts over minutes
            print(f"# rep {rep + 1}/{args.reps}: {name}", file=sys.stderr, flush=True)
            results[name].append(fn())

    print(table(results, args.coll, args.np, args.reps, with_gloo=not args.no_gloo))
    if args.csv:
        write_csv(args.csv, results, args.coll, args.np)
        print(f"\nraw figures: {args.csv}")

    if args.plot:
        peers_csv = os.path.splitext(args.plot)[0] + ".peers.csv"
        with open(peers_csv, "w") as f:
            f.write("name,size_bytes,busbw_gbps\n")
            for name in results:
                if name == "cohort shm":
                    continue  # the plotting run below draws cohort over shm itself
                for s in SIZES:
                    v = median_of(results, name, s, 1)
                    if v is not None:
                        f.write(f"{name} (median),{s},{v}\n")
        run([args.cohort, "run", "--standalone", "--nproc-per-node", str(args.np), args.cohort, "bench", args.coll, "--sizes", sizes,
             "-n", "0", "-w", "5", "-c", "1", "--plot", args.plot, "--plot-peers", peers_csv])
        print(f"\nplot: {args.plot} (peers' medians in {peers_csv})")


if __name__ == "__main__":
    main()
