#!/usr/bin/env python3
"""Tensor and data parallelism on the GPT example: cohort's examples/gpt
against PyTorch 2.13's DTensor tensor parallelism with DDP (bench/gpt_tp_peer.py)
on the same model, batch and optimizer, one intra-op thread per rank, the two
sides interleaved REPS times (median tokens/s). Prints a table with the ratio
per layout and, with --csv, writes the raw figures.

    bench/gpt_compare.py [--reps 3] [--steps 60] [--layouts 1x1,1x2,2x2] [--csv docs/perf/gpt-tp.csv]

A layout DPxTP runs DP*TP processes (4 processes on this 2-core machine are
oversubscribed: compare the two sides, not the layouts).
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import perf_csv  # noqa: E402

ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
CSV_HEADER = "measured_utc,bench,layout,who,rep,tokens_per_s,loss"


def result(text, tag):
    m = re.search(rf"RESULT {tag} .*tokens_per_s=([0-9.]+)", text)
    loss = re.search(r"step \d+ loss ([0-9.]+)\s*$", text, re.M) if tag == "gpt" else re.search(r"loss=([0-9.]+)", text)
    return (float(m.group(1)) if m else None, float(loss.group(1)) if loss else None)


def launch(cmd, tag):
    env = dict(os.environ)
    env.update(ENV)
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
    got = result(p.stdout, tag)
    if p.returncode != 0 or got[0] is None:
        sys.exit(f"gpt_compare: no result from {' '.join(cmd)}\n{p.stdout[-3000:]}")
    return got


def ours(build, dp, tp, steps):
    return launch([f"{build}/cohort", "run", "--standalone", "--nproc-per-node", str(dp * tp), f"{build}/gpt",
                   "--tp", str(tp), "--dp", str(dp), "--max-steps", str(steps), "--print-every", str(steps),
                   "--val-seqs", "32"], "gpt")


def peer(python, dp, tp, steps):
    return launch([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(dp * tp),
                   f"{HERE}/gpt_tp_peer.py", "--tp", str(tp), "--dp", str(dp), "--max-steps", str(steps)], "gpt_peer")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--layouts", default="1x1,1x2,2x2", help="DPxTP, comma-separated")
    ap.add_argument("--build", default=f"{ROOT}/build")
    ap.add_argument("--csv")
    a = ap.parse_args()
    py = subprocess.run([f"{ROOT}/scripts/install-pytorch-peer.sh", "2.13.0"], stdout=subprocess.PIPE, text=True,
                        check=True).stdout.strip()
    layouts = [tuple(int(x) for x in l.split("x")) for l in a.layouts.split(",")]
    runs = {}  # (layout, who) -> [(tokens/s, loss)]
    for rep in range(a.reps):
        for dp, tp in layouts:
            key = f"dp{dp}xtp{tp}"
            runs.setdefault((key, "cohort"), []).append(ours(a.build, dp, tp, a.steps))
            runs.setdefault((key, "pytorch2.13"), []).append(peer(py, dp, tp, a.steps))
            print(f"rep {rep + 1} {key}: cohort {runs[(key, 'cohort')][-1][0]:.0f} tokens/s, "
                  f"pytorch2.13 {runs[(key, 'pytorch2.13')][-1][0]:.0f} tokens/s", flush=True)
    print(f"\n| layout | processes | cohort tokens/s | PyTorch 2.13 tokens/s | ratio | loss at step {a.steps} (cohort / peer) |")
    print("|---|---|---|---|---|---|")
    for dp, tp in layouts:
        key = f"dp{dp}xtp{tp}"
        ours_med = statistics.median(r[0] for r in runs[(key, "cohort")])
        peer_med = statistics.median(r[0] for r in runs[(key, "pytorch2.13")])
        print(f"| dp {dp} x tp {tp} | {dp * tp} | {ours_med:.0f} | {peer_med:.0f} | {ours_med / peer_med:.2f}x | "
              f"{runs[(key, 'cohort')][-1][1]:.4f} / {runs[(key, 'pytorch2.13')][-1][1]:.4f} |")
    if a.csv:
        stamp = perf_csv.now_utc()
        lines = [[stamp, "gpt_tp", key, who, i + 1, f"{t:.0f}", f"{l:.4f}"]
                 for (key, who), rs in runs.items() for i, (t, l) in enumerate(rs)]
        perf_csv.write(a.csv, CSV_HEADER, lines)


if __name__ == "__main__":
    main()
