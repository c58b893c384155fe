#!/usr/bin/env python3
"""`cohort plan`'s predicted DDP step time against the measured one, for the
example models (examples/fashion_mnist --model mlp and cnn) at 2 ranks on 2
"hosts": network namespaces joined by veth links that tc limits to --rate.

For each model: the compute per sample is measured at 1 rank (the example's
own images/s); the plan then predicts the step of DDP x2 from that, the
calibration file (shm and tcp_cross classes, from `cohort bench --calibrate`,
e.g. bench/plan_accuracy.py --calibration FILE) and the link's speed
(--inter-host-gbps); last, the example runs across the two namespaces and its
images/s gives the measured step. Prints both and their ratio.

  sudo bench/plan_ddp.py --build build --calibration cal.json [--rate 1gbit] [--reps 2]
"""
import argparse
import csv
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from hierarchical_netns import Lab, run_on_both  # noqa: E402

BATCH = 64  # the example's --batch-size per rank


def images_per_s(out):
    m = re.search(r"RESULT ddp_summary .*imgs_per_s=([0-9.]+)", out)
    if not m:
        raise SystemExit(f"plan_ddp: no RESULT line in:\n{out[-3000:]}")
    return float(m.group(1))


def example(build, model, steps, skip):
    return [os.path.abspath(f"{build}/fashion_mnist"), "--model", model, "--max-steps", str(steps), "--epochs", "1",
            "--augment", "none", "--warmup-timing-steps", str(skip), "--batch-size", str(BATCH)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--gbps", type=float, default=1.0, help="the rate in Gbit/s, for the plan")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=10)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--csv", metavar="FILE")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("plan_ddp: needs root to create network namespaces")
    cohort = os.path.abspath(f"{args.build}/cohort")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rows = []
    lab = Lab(args.rate, machines=2)
    port = 29950
    try:
        for model in args.models.split(","):
            one, two = [], []
            for rep in range(args.reps):
                print(f"# {model} rep {rep + 1}: 1 rank", file=sys.stderr, flush=True)
                p = subprocess.run([cohort, "run", "--standalone", "--nproc-per-node", "1",
                                    *example(args.build, model, args.steps, args.skip)],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
                one.append(images_per_s(p.stdout))
                print(f"# {model} rep {rep + 1}: 2 hosts x 1 rank over {args.rate}", file=sys.stderr, flush=True)
                port += 2
                two.append(images_per_s(run_on_both(lab, cohort, example(args.build, model, args.steps, args.skip), {},
                                                    port, per_host=1)))
            sample_ms = 1000 / (sum(one) / len(one))
            plan = subprocess.run([cohort, "plan", "--model", model, "--calibration", args.calibration, "--hosts", "2",
                                   "--ranks-per-host", "1", "--same-machine", "--inter-host-gbps", str(args.gbps),
                                   "--device-memory-gb", "8", "--sample-ms", f"{sample_ms:.6f}", "--global-batch",
                                   str(2 * BATCH), "--csv"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
            if plan.returncode != 0:
                raise SystemExit(f"plan_ddp: cohort plan failed:\n{plan.stdout}")
            ddp = next(r for r in csv.DictReader(plan.stdout.splitlines()) if r["layout"] == "DDP x2")
            predicted = float(ddp["step_ms"])
            measured = 1000 * 2 * BATCH / (sum(two) / len(two))
            rows.append((model, sample_ms, float(ddp["compute_ms"]), float(ddp["dp_ms"]),
                         float(ddp["dp_exposed_ms"]), predicted, measured, two))
    finally:
        lab.remove()
    print(f"| model | compute per sample (1 rank) | predicted: compute + exposed allreduce (allreduce) | predicted step "
          f"| measured step (2 x 1 over {args.rate}) | predicted / measured |")
    print("|---|---|---|---|---|---|")
    for model, sms, comp, dp, exp, pred, meas, two in rows:
        print(f"| {model} | {sms:.3f} ms | {comp:.1f} + {exp:.1f} ({dp:.1f}) ms | {pred:.1f} ms | {meas:.1f} ms "
              f"({', '.join(f'{x:.0f}' for x in two)} images/s) | {pred / meas:.2f} |")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["model", "rate", "sample_ms", "compute_ms", "allreduce_ms", "exposed_ms", "predicted_step_ms",
                        "measured_step_ms", "predicted_over_measured"])
            for model, sms, comp, dp, exp, pred, meas, _ in rows:
                w.writerow([model, args.rate, f"{sms:.4f}", f"{comp:.2f}", f"{dp:.2f}", f"{exp:.2f}", f"{pred:.2f}",
                            f"{meas:.2f}", f"{pred / meas:.4f}"])


if __name__ == "__main__":
    main()
