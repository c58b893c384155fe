#!/usr/bin/env python3
"""Sharded data parallelism: cohort's ZeroOptimizer (ZeRO-1, ZeRO-2),
FullyShardedDataParallel and DDP against PyTorch 2.13's ZeroRedundancyOptimizer,
FSDP2 (fully_shard on a CPU mesh) and DDP (gloo), on the Fashion-MNIST example,
AdamW, interleaved REPS times (median). Per run: images/s, the largest
per-rank peak RSS, and rank 0's optimizer state. One intra-op thread per rank
on both sides. Invoked by bench/zero_compare.sh; the tables go to
docs/performance.md (bench/write_performance.py renders them from --csv).

    bench/zero_compare.sh [--reps 3] [--model mlp] [--steps 120] [--csv docs/perf/zero-np2.csv]
    bench/zero_compare.sh --world 4 --model big-mlp --steps 5 --timing-skip 2 --reps 1 \
        --configs cohort:ddp,fsdp --csv docs/perf/fsdp-np4.csv   # FSDP memory against DDP
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ddp_scaling  # noqa: E402  (the same environment, launch and peer install as the DDP benchmark)
import perf_csv  # noqa: E402

CSV_HEADER = "measured_utc,bench,model,world,who,config,rep,imgs_per_s,peak_rss_mb,optimizer_state_mb"
# (who, config) in the order of the table's rows; ratios compare each cohort row with the peer row named.
ROWS = [("cohort", "ddp"), ("cohort", "zero1"), ("cohort", "zero2"), ("cohort", "fsdp"), ("pytorch2.13", "ddp"),
        ("pytorch2.13", "zero"), ("pytorch2.13", "fsdp")]
RATIOS = [(("cohort", "zero1"), ("pytorch2.13", "zero")), (("cohort", "zero2"), ("pytorch2.13", "zero")),
          (("cohort", "fsdp"), ("pytorch2.13", "fsdp")), (("cohort", "ddp"), ("pytorch2.13", "ddp")),
          (("cohort", "fsdp"), ("cohort", "ddp")), (("pytorch2.13", "fsdp"), ("pytorch2.13", "ddp"))]
PEER_FLAG = {"ddp": [], "zero": ["--zero"], "fsdp": ["--fsdp"]}


def figures(text):
    """(images/s, peak RSS MB, optimizer state MB) from a run's RESULT lines; None where missing."""
    ips = re.search(r"RESULT ddp_summary .*imgs_per_s=([0-9.]+)", text)
    mem = re.search(r"RESULT memory .*peak_rss_mb=([0-9.]+) optimizer_state_mb=([0-9.]+)", text)
    return (float(ips.group(1)) if ips else None, float(mem.group(1)) if mem else None,
            float(mem.group(2)) if mem else None)


def launch(cmd):
    env = dict(os.environ)
    env.update(ddp_scaling.ENV)
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
    got = figures(p.stdout)
    if None in got:
        sys.stderr.write(f"no result from: {' '.join(cmd)}\n{p.stdout[-2000:]}\n")
    return got


def ours(build, model, world, steps, skip, config):
    cmd = [f"{build}/cohort", "run", "--nproc-per-node", str(world), f"{build}/fashion_mnist", "--model", model,
           "--max-steps", str(steps), "--augment", "none", "--epochs", "1", "--optimizer", "adamw",
           "--warmup-steps", "0", "--warmup-timing-steps", str(skip)]
    return launch(cmd + ([] if config == "ddp" else ["--shard", config]))


def peer(python, model, world, steps, skip, config):
    cmd = [python, "-m", "torch.distributed.run", "--redirects", "9:0", "--tee", "9:0", "--standalone",
           "--nproc_per_node", str(world), f"{HERE}/peers/torch_ddp_fmnist.py", "--model", model, "--max-steps",
           str(steps), "--optimizer", "adamw", "--warmup-steps", str(skip)]
    return launch(cmd + PEER_FLAG[config])


def write_csv(path, model, world, results):
    when = perf_csv.now_utc()
    perf_csv.write(path, CSV_HEADER, ([when, "zero_compare", model, world, who, config, rep + 1, *run]
                                      for (who, config), runs in results.items() for rep, run in enumerate(runs)))


def read_csv(path):
    """(measured_utc, model, world, reps, results) as write_csv wrote them."""
    results, when, model, world, reps = {}, None, None, None, 0
    num = lambda v: None if v == "None" else float(v)  # noqa: E731
    for when, _, model, w, who, config, rep, ips, rss, state in perf_csv.rows(path, CSV_HEADER, "zero_compare"):
        world, reps = int(w), max(reps, int(rep))
        results.setdefault((who, config), []).append((num(ips), num(rss), num(state)))
    return when, model, world, reps, results


def table(results, model, world, reps):
    def med(key, i):
        vals = [r[i] for r in results.get(key, []) if r[i] is not None]
        return statistics.median(vals) if vals else None

    f = lambda v, fmt="{:.0f}": "-" if v is None else fmt.format(v)  # noqa: E731
    out = [f"| who | sharding | images/s | peak RSS per rank (MB) | optimizer state per rank (MB) |", "|---|---|---|---|---|"]
    for key in ROWS:
        if key in results:
            out.append(f"| {key[0]} | {key[1]} | {f(med(key, 0))} | {f(med(key, 1))} | {f(med(key, 2), '{:.1f}')} |")
    out.append("")
    out.append("| ratio | images/s | peak RSS |")
    out.append("|---|---|---|")
    for a, b in RATIOS:
        if a in results and b in results:
            ia, ib, ra, rb = med(a, 0), med(b, 0), med(a, 1), med(b, 1)
            r1 = f"{ia / ib:.2f}x" if ia and ib else "-"
            r2 = f"{ra / rb:.2f}x" if ra and rb else "-"
            out.append(f"| {a[0]} {a[1]} / {b[0]} {b[1]} | {r1} | {r2} |")
    runs = "; ".join(f"{w} {c} " + " ".join(f(r[0]) for r in results[(w, c)]) for w, c in ROWS if (w, c) in results)
    out.append(f"\nEvery run's images/s: {runs}.")
    return f"{model}, AdamW, world {world}, median of {reps} interleaved runs\n\n" + "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default="mlp", choices=["mlp", "cnn", "big-mlp"])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--timing-skip", type=int, default=20, help="first steps left out of images/s (both sides)")
    ap.add_argument("--configs", default="ddp,zero1,zero2,zero,fsdp",
                    help="which rows to run: cohort's ddp, zero1, zero2, fsdp and PyTorch's ddp, zero, fsdp; "
                         "a name alone runs both sides' row, cohort:ddp or pytorch2.13:fsdp one")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--build", default=ddp_scaling.BUILD)
    ap.add_argument("--csv", metavar="FILE", help="also write every run's figures here (docs/perf/zero-np2.csv)")
    args = ap.parse_args()
    py = subprocess.run([f"{ddp_scaling.ROOT}/scripts/install-pytorch-peer.sh", "2.13.0"],
                        stdout=subprocess.PIPE, text=True, check=True).stdout.strip()
    results = {}
    wanted = set(args.configs.split(","))
    for rep in range(args.reps):
        for who, config in ROWS:
            if config not in wanted and f"{who}:{config}" not in wanted:
                continue
            got = (ours(args.build, args.model, args.world, args.steps, args.timing_skip, config) if who == "cohort"
                   else peer(py, args.model, args.world, args.steps, args.timing_skip, config))
            print(f"# rep {rep + 1}/{args.reps} {who} {config}: {got}", file=sys.stderr, flush=True)
            results.setdefault((who, config), []).append(got)
    print(table(results, args.model, args.world, args.reps))
    if args.csv:
        write_csv(args.csv, args.model, args.world, results)
        print(f"\nraw figures: {args.csv}")


if __name__ == "__main__":
    main()
