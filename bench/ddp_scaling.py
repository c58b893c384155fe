#!/usr/bin/env python3
"""DDP throughput: cohort's Fashion-MNIST example against PyTorch DDP (gloo) on
the same models, world sizes 1 and 2, interleaved REPS times (median). The
peers are Debian's PyTorch 1.13 (/usr/bin/python3) and PyTorch 2.13 (a
virtual environment from scripts/install-pytorch-peer.sh); the ratios are
against the faster of the two. One
intra-op thread per rank (OMP_NUM_THREADS=OPENBLAS_NUM_THREADS=1) on both sides.
Invoked by bench/ddp_scaling.sh; with --csv FILE (docs/perf/ddp-scaling.csv) every
run's images/s is written there, and bench/write_performance.py puts the table into
docs/performance.md.

World 2 runs in three modes:
  sync      DDP as users run it (gradients averaged every step);
  lockstep  no gradient traffic, but a barrier after every backward: the ranks
            still wait for each other once per step (--no-allreduce --lockstep);
  no sync   no gradient traffic and no waiting (--no-allreduce): the ceiling
            that compute alone allows.
ceiling -> lockstep is what any synchronous step costs (each step runs at the
pace of the slower rank); lockstep -> sync is what gradient communication
costs on top of that.
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


def ips(text):
    m = re.search(r"RESULT ddp_summary .*imgs_per_s=([0-9.]+)", text)
    return float(m.group(1)) if m else None


def run(cmd):
    env = dict(os.environ)
    env.update(ENV)
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1200)
    v = ips(p.stdout)
    if v is None:
        sys.stderr.write(f"no result from: {' '.join(cmd)}\n{p.stdout[-2000:]}\n")
    return v


MODES = {"sync": [], "lockstep": ["--no-allreduce", "--lockstep"], "nosync": ["--no-allreduce"]}


BUILD = f"{ROOT}/build"


def ours(model, world, steps, mode):
    cmd = [f"{BUILD}/cohort", "run", "--nproc-per-node", str(world), f"{BUILD}/fashion_mnist", "--model", model,
           "--max-steps", str(steps), "--augment", "none", "--epochs", "1",
           # The peer's optimizer: SGD(lr 0.01 x world, momentum 0.9), no weight decay, no schedule. Weight decay
           # alone costs our MLP ~8% (one more pass over 40 MB of parameters per step), so it must match.
           "--lr", "0.01", "--weight-decay", "0", "--warmup-steps", "0"]
    return run(cmd + MODES[mode])


def peer(python, model, world, steps, mode):
    cmd = [python, "-m", "torch.distributed.run", "--redirects", "9:0", "--tee", "9:0", "--standalone",
           "--nproc_per_node", str(world), f"{HERE}/peers/torch_ddp_fmnist.py", "--model", model, "--max-steps", str(steps)]
    return run(cmd + MODES[mode])


def ensure_peer():
    """The peer needs Debian's python3-torch; install it as bench/compare_peers.sh does, or say how."""
    if subprocess.run(["/usr/bin/python3", "-c", "import torch"], capture_output=True).returncode == 0:
        return
    sys.stderr.write("ddp_scaling: PyTorch (python3-torch) is missing; installing the peers with scripts/install-deps.sh --peers\n")
    if subprocess.run([f"{ROOT}/scripts/install-deps.sh", "--peers"]).returncode != 0:
        sys.exit("ddp_scaling: could not install python3-torch; run scripts/install-deps.sh --peers as root")


def main():
    global BUILD
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--models", default="cnn,mlp")
    ap.add_argument("--build", default=BUILD, help="cohort's build directory (its LibTorch is the one it was built with)")
    ap.add_argument("--peer-versions", default="1.13,2.13.0",
                    help="PyTorch peers: 1.13 is Debian's python3-torch, others come from scripts/install-pytorch-peer.sh")
    ap.add_argument("--csv", metavar="FILE", help="also write every run's images/s here (docs/perf/ddp-scaling.csv)")
    args = ap.parse_args()
    BUILD = args.build
    ensure_peer()
    peers = {}
    for v in args.peer_versions.split(","):
        if v == "1.13":
            peers["pytorch1.13"] = "/usr/bin/python3"
        else:
            py = subprocess.run([f"{ROOT}/scripts/install-pytorch-peer.sh", v], stdout=subprocess.PIPE, text=True,
                                check=True).stdout.strip()
            peers["pytorch" + ".".join(v.split(".")[:2])] = py
    whos = ["cohort"] + list(peers)
    steps = {"cnn": 300, "mlp": 120}
    configs = [(1, "sync"), (2, "sync"), (2, "lockstep"), (2, "nosync")]
    res = {}
    for rep in range(args.reps):
        for model in args.models.split(","):
            for w, mode in configs:
                for who in whos:
                    v = ours(model, w, steps[model], mode) if who == "cohort" else peer(peers[who], model, w,
                                                                                         steps[model], mode)
                    print(f"# rep {rep + 1}/{args.reps} {who} {model} world {w} {mode}: {v} img/s", file=sys.stderr,
                          flush=True)
                    res.setdefault((who, model, w, mode), []).append(v)

    print(table(res, args.models.split(","), whos, args.reps))
    if args.csv:
        write_csv(args.csv, res)
        print(f"\nraw figures: {args.csv}")


CSV_HEADER = "measured_utc,bench,model,who,world,mode,rep,imgs_per_s"


def write_csv(path, res):
    """Every run's images/s, one line per (who, model, world, mode, rep), stamped with the time of writing."""
    when = perf_csv.now_utc()
    perf_csv.write(path, CSV_HEADER, ([when, "ddp_scaling", model, who, w, mode, rep + 1, v]
                                      for (who, model, w, mode), vals in sorted(res.items())
                                      for rep, v in enumerate(vals)))


def read_csv(path):
    """(measured_utc, models, whos, reps, res) as write_csv wrote them."""
    res, when, models, whos, reps = {}, None, [], [], 0
    for when, _, model, who, w, mode, rep, v in perf_csv.rows(path, CSV_HEADER, "ddp_scaling"):
        models += [model] if model not in models else []
        whos += [who] if who not in whos else []
        reps = max(reps, int(rep))
        res.setdefault((who, model, int(w), mode), []).append(None if v == "None" else float(v))
    whos.sort(key=lambda w: (w != "cohort", w))
    return when, models, whos, reps, res


def table(res, models, whos, reps):
    """The printed tables and ratio lines, from res: (who, model, world, mode) -> images/s per rep."""
    out = ["## every run, images/s (the spread between runs is part of the result)\n"]
    for (who, model, w, mode), vals in sorted(res.items()):
        shown = ", ".join("-" if v is None else f"{v:.0f}" for v in vals)
        out.append(f"- {model} {who} world {w} {mode}: {shown}")
    out.append("")

    def med(k):
        v = [x for x in res.get(k, []) if x is not None]
        return statistics.median(v) if v else None

    def ratio(a, b):
        return f"{a / b:.2f}" if a and b else "-"

    out.append(f"## DDP throughput, images/s (median of {reps} interleaved runs, 1 thread per rank)\n")
    out.append("| model | who | world 1 | world 2 | w2 lockstep | w2 no sync | efficiency w2/(2 w1) | w2 / own no-sync "
               "ceiling | lockstep / ceiling | w2 / lockstep |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    f = lambda v: f"{v:.0f}" if v else "-"  # noqa: E731
    for model in models:
        for who in whos:
            w1, w2 = med((who, model, 1, "sync")), med((who, model, 2, "sync"))
            ls, ns = med((who, model, 2, "lockstep")), med((who, model, 2, "nosync"))
            eff = ratio(w2, 2 * w1) if w1 else "-"
            out.append(f"| {model} | {who} | {f(w1)} | {f(w2)} | {f(ls)} | {f(ns)} | {eff} | {ratio(w2, ns)} | "
                       f"{ratio(ls, ns)} | {ratio(w2, ls)} |")
    out.append("")
    peers = [w for w in whos if w != "cohort"]
    for model in models:
        a, c = med(("cohort", model, 2, "sync")), med(("cohort", model, 1, "sync"))
        for who in peers:
            b, d = med((who, model, 2, "sync")), med((who, model, 1, "sync"))
            if a and b and c and d:
                out.append(f"- {model}: cohort / {who} DDP at world 2: {a / b:.2f}x; at world 1: {c / d:.2f}x")
        best2 = max((med((w, model, 2, "sync")) or 0 for w in peers), default=0)
        best1 = max((med((w, model, 1, "sync")) or 0 for w in peers), default=0)
        if a and c and best2 and best1:
            out.append(f"- {model}: cohort / the faster PyTorch at world 2: {a / best2:.2f}x; at world 1: {c / best1:.2f}x")
    return "\n".join(out)


if __name__ == "__main__":
    main()
