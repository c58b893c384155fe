#!/usr/bin/env python3
"""DDP's gradient compression across a slow link: the example's model trained
on 2 "hosts" (network namespaces joined by veth links, limited by tc to
--rate) of --per-host ranks each, with each --comm-hook, interleaved REPS
times. Prints images/s and the bytes that crossed machine 0's link per step in the
steady state, with ratios to the plain allreduce: rank 0's step metrics
(COHORT_METRICS) give its interface counters over a run, and the difference
between a run of 2 STEPS and one of STEPS steps, divided by STEPS, leaves out
the start-up and a compressing hook's first plain iterations. Needs root and iproute2; never touches the host's own
network.

  sudo bench/compression_netns.py --build build [--hooks allreduce,int8,bf16] [--rate 1gbit] [--reps 2]
"""
import argparse
import json
import os
import re
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from hierarchical_netns import Lab, run_on_both  # noqa: E402


def one_run(lab, build, hook, args, port, steps):
    """(images/s, bytes over machine 0's link over the whole run)."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        prog = [f"{build}/fashion_mnist", "--model", args.model, "--max-steps", str(steps), "--augment", "none",
                "--epochs", "1", "--warmup-timing-steps", str(args.skip), "--comm-hook", hook]
        out = run_on_both(lab, os.path.abspath(f"{build}/cohort"), prog, {"COHORT_METRICS": metrics}, port,
                          per_host=args.per_host)
        ips = re.search(r"RESULT ddp_summary .*imgs_per_s=([0-9.]+)", out)
        link = None
        if os.path.exists(metrics):
            for line in open(metrics):
                j = json.loads(line)
                if j.get("kind") == "summary" and j.get("rank") == 0:
                    eth = j.get("net", {}).get("eth0")
                    if eth:
                        link = eth["rx_bytes"] + eth["tx_bytes"]
        if not ips or link is None:
            sys.stderr.write(f"{hook}: no result\n{out[-2500:]}\n")
        return (float(ips.group(1)) if ips else None, link)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--hooks", default="allreduce,int8,bf16")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=10, help="steps left out of the timing")
    ap.add_argument("--per-host", type=int, default=1)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("compression_netns: needs root to create network namespaces")
    hooks = args.hooks.split(",")
    lab = Lab(args.rate)
    results = {h: [] for h in hooks}
    try:
        port = 29800
        short = {}
        for rep in range(args.reps):
            for h in hooks:
                print(f"# rep {rep + 1}/{args.reps}: {h}", file=sys.stderr, flush=True)
                if rep == 0:
                    port += 2
                    short[h] = one_run(lab, args.build, h, args, port, args.steps)[1]
                port += 2
                ips, link = one_run(lab, args.build, h, args, port, 2 * args.steps)
                per_step = (link - short[h]) / args.steps if link is not None and short[h] is not None else None
                results[h].append((ips, per_step))
    finally:
        lab.remove()

    def med(h, i):
        vals = [r[i] for r in results[h] if r[i] is not None]
        return statistics.median(vals) if vals else None
    base_ips, base_link = med("allreduce", 0), med("allreduce", 1)
    print(f"## {args.model}, 2 hosts x {args.per_host} rank(s), link {args.rate or 'unlimited'}, "
          f"median of {args.reps} interleaved runs of {2 * args.steps} steps ({args.skip} untimed)\n")
    print("| comm hook | images/s | bytes over the link per step (steady state) | images/s vs allreduce | "
          "bytes vs allreduce |")
    print("|---|---|---|---|---|")
    for h in hooks:
        ips, link = med(h, 0), med(h, 1)
        r_ips = f"{ips / base_ips:.2f}x" if ips and base_ips else "-"
        r_link = f"{link / base_link:.3f}x" if link and base_link else "-"
        print(f"| {h} | {ips if ips is None else round(ips, 1)} | "
              f"{'-' if link is None else f'{link / 1e6:.2f} MB'} | {r_ips} | {r_link} |")


if __name__ == "__main__":
    main()
