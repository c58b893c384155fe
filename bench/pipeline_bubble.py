#!/usr/bin/env python3
"""The pipeline bubble measured from the runner's own timeline: examples/gpt
at pp 2 (one process per core here) under GPipe, 1F1B and interleaved 1F1B
for several micro-batch counts. Each stage records when each forward and
backward computed (PipelineStats); the bubble is the share of the step a
stage computed nothing, averaged over the timed steps (RESULT bubble=, stage
0) and, for the last step, per stage from the --schedule-trace files. Beside
it, the formula of GPipe and 1F1B, (p-1)/(m+p-1), and of the interleaved
schedule with v chunks, (p-1)/(v*m+p-1) (Narayanan et al., SC 2021).

    bench/pipeline_bubble.py [--steps 30] [--picture docs/perf/pipeline-1f1b.txt] [--csv docs/perf/pipeline-bubble.csv]

--picture draws the last step of 1F1B with m = 4 as text: one row per stage,
forwards as the micro-batch's digit, backwards as its letter (a = 0), idle '.'.
"""
import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import perf_csv  # noqa: E402

ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
CSV_HEADER = "measured_utc,bench,schedule,stages,micro,chunks,formula,bubble_stage0_mean,bubble_last_step_by_stage"
CASES = [("gpipe", 4, 1), ("1f1b", 2, 1), ("1f1b", 4, 1), ("1f1b", 8, 1), ("interleaved", 4, 2), ("interleaved", 8, 2)]


def formula(schedule, p, m, v):
    return (p - 1) / ((v if schedule == "interleaved" else 1) * m + p - 1)


def read_trace(path):
    with open(path) as f:
        head = f.readline()
        rows = [line.split() for line in f if line.strip()]
    stage = int(re.search(r"stage (\d+)", head).group(1))
    step_s = float(re.search(r"step_s ([0-9.]+)", head).group(1))
    origin = float(re.search(r"origin_s ([0-9.]+)", head).group(1))
    acts = [(k, int(m), int(c), float(s), float(e)) for k, m, c, s, e in rows]
    return stage, step_s, origin, acts


def picture(traces, width=96):
    t0 = min(o for _, _, o, _ in traces)
    t1 = max(o + s for _, s, o, _ in traces)
    scale = width / (t1 - t0)
    lines = []
    for stage, _, origin, acts in sorted(traces):
        row = ["."] * width
        for kind, micro, _, s, e in acts:
            a, b = int((origin + s - t0) * scale), max(int((origin + s - t0) * scale) + 1, int((origin + e - t0) * scale))
            for i in range(a, min(b, width)):
                row[i] = str(micro) if kind == "F" else chr(ord("a") + micro)
        lines.append(f"stage {stage} |{''.join(row)}|")
    lines.append(f"        0{' ' * (width - 12)}{(t1 - t0) * 1e3:.1f} ms")
    return "\n".join(lines)


def run_case(build, schedule, m, v, steps, trace, layers, batch):
    cmd = [f"{build}/cohort", "run", "--standalone", "--nproc-per-node", "2", f"{build}/gpt", "--pp", "2", "--layers", str(layers), "--batch", str(batch),
           "--schedule", schedule, "--micro", str(m), "--chunks", str(v), "--max-steps", str(steps),
           "--print-every", str(steps), "--val-seqs", "32", "--schedule-trace", trace]
    env = dict(os.environ)
    env.update(ENV)
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
    got = re.search(r"RESULT gpt .*bubble=([0-9.]+)", p.stdout)
    if p.returncode != 0 or not got:
        sys.exit(f"pipeline_bubble: no result from {' '.join(cmd)}\n{p.stdout[-3000:]}")
    traces = [read_trace(f) for f in sorted(glob.glob(trace + ".rank*"))]
    by_stage = {}
    for stage, step_s, _, acts in traces:
        busy = sum(e - s for _, _, _, s, e in acts)
        by_stage[stage] = 1 - busy / step_s
    return float(got.group(1)), by_stage, traces


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=8,
                    help="blocks (the last stage also runs the head: more blocks make the stages more even)")
    ap.add_argument("--batch", type=int, default=64,
                    help="sequences per step: at m = 8 still 8 per micro-batch, so each action outweighs its message")
    ap.add_argument("--build", default=f"{ROOT}/build")
    ap.add_argument("--picture")
    ap.add_argument("--csv")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="cohort_bubble_")
    print("| schedule | p | m | chunks | formula | measured, stage 0 (mean) | measured, last step, by stage |")
    print("|---|---|---|---|---|---|---|")
    lines, stamp = [], perf_csv.now_utc()
    for schedule, m, v in CASES:
        trace = f"{tmp}/{schedule}-{m}-{v}"
        mean, by_stage, traces = run_case(a.build, schedule, m, v, a.steps, trace, a.layers, a.batch)
        f = formula(schedule, 2, m, v)
        stages = " / ".join(f"{by_stage[s]:.3f}" for s in sorted(by_stage))
        print(f"| {schedule} | 2 | {m} | {v} | {f:.3f} | {mean:.3f} | {stages} |", flush=True)
        lines.append([stamp, "pipeline_bubble", schedule, 2, m, v, f"{f:.4f}", f"{mean:.4f}", stages.replace(" / ", ";")])
        if a.picture and schedule == "1f1b" and m == 4:
            text = picture(traces)
            print(text)
            with open(a.picture, "w") as out:
                out.write(f"1F1B, 2 stages, 4 micro-batches of {a.batch // 4}: the last of {a.steps} steps of examples/gpt "
                          f"(measured {stamp} UTC)\n{text}\n")
    if a.csv:
        perf_csv.write(a.csv, CSV_HEADER, lines)


if __name__ == "__main__":
    main()
