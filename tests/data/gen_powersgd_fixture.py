#!/usr/bin/env python3
"""Writes tests/data/powersgd_fixture.json: what PyTorch's powerSGD_hook gives
on gloo at world 2 for a bucket of known gradients and a known first Q, for
tests/ddp_powersgd_test.cpp (cohort's powersgd_hook must agree to 1e-5).

Run with PyTorch 2.13 (scripts/install-pytorch-peer.sh 2.13.0):

    ~/.cache/cohort/pytorch-2.13.0/bin/python tests/data/gen_powersgd_fixture.py > tests/data/powersgd_fixture.json

The hook is called directly on a stand-in for DDP's GradBucket (buffer(),
gradients(), index(), is_last()), one bucket, 4 iterations: 2 plain (the
state's start_powerSGD_iter) and 2 compressed, the second of which uses the
first's error feedback and warm-started Q. Gradients and the first Q follow
closed formulas the C++ test computes too.
"""
import json
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

# The bucket's parameters, in bucket order: two of one shape (grouped in P and
# Q), a bias, a matrix too small to compress at rank 4, a 3-D one viewed as
# 6 x 40.
SHAPES = [(32, 24), (32,), (8, 16), (8,), (32, 24), (6, 4, 10)]
STEPS = 4
START = 2


def grad(rank, step, i):
    # A smooth part of rank 2 as a matrix, and a part of full rank (the i * i term).
    return math.sin(0.013 * i * (step + 1) + rank) * (1.0 + 0.1 * rank) + 0.5 * math.sin(0.0007 * i * i + 0.2 * step + rank)


def first_q(i):
    # Of full rank as a matrix (a sine of i alone has rank 2, and the columns
    # a QR makes up for the rest would be rounding noise).
    return math.sin(0.1 * i + 0.3) + 0.5 * math.sin(0.013 * i * i + 1.0)


class Bucket:
    def __init__(self, flat):
        self.flat = flat

    def buffer(self):
        return self.flat

    def gradients(self):
        out, at = [], 0
        for s in SHAPES:
            n = math.prod(s)
            out.append(self.flat[at:at + n].view(s))
            at += n
        return out

    def index(self):
        return 0

    def is_last(self):
        return True


def worker(rank, rank_r, port, queue):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=rank_r, start_powerSGD_iter=START,
                             min_compression_rate=2, use_error_feedback=True, warm_start=True)
    total = sum(math.prod(s) for s in SHAPES)
    results = []
    for step in range(STEPS):
        flat = torch.tensor([grad(rank, step, i) for i in range(total)], dtype=torch.float32)
        if step == START:
            # The first Q, in the layout the hook allocates, instead of a random one.
            q_len = p_len = 0
            for s in SHAPES:
                n, m = s[0], math.prod(s[1:]) if len(s) > 1 else 1
                r = min(n, m, rank_r)
                if (n + m) * r * 2 < n * m:
                    q_len += m * r
                    p_len += n * r
            state.q_memory_dict[0] = torch.tensor([first_q(i) for i in range(q_len)], dtype=torch.float32)
            state.p_memory_dict[0] = torch.zeros(p_len, dtype=torch.float32)
        out = ps.powerSGD_hook(state, Bucket(flat)).wait()
        results.append([float(v) for v in out])
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main():
    fixture = {"shapes": [list(s) for s in SHAPES], "start": START, "steps": STEPS, "world": 2, "torch": torch.__version__,
               "results": {}}
    ctx = mp.get_context("spawn")
    for rank_r in (1, 4):
        queue = ctx.Queue()
        port = 29950 + rank_r
        procs = [ctx.Process(target=worker, args=(r, rank_r, port, queue)) for r in range(2)]
        for p in procs:
            p.start()
        res = queue.get(timeout=120)
        for p in procs:
            p.join()
        fixture["results"][str(rank_r)] = [[float(f"{v:.9g}") for v in step] for step in res]
    json.dump(fixture, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
