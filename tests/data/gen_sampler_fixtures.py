#!/usr/bin/env python3
"""Writes tests/data/sampler_fixtures.json: what PyTorch itself yields, for cohort's
DistributedSampler and randperm tests (tests/data_sampler_test.cpp).

Run with the PyTorch whose behaviour cohort matches (Debian's python3-torch 1.13):

    python3 tests/data/gen_sampler_fixtures.py > tests/data/sampler_fixtures.json

Small results are stored whole; results of more than MAX_FULL indices are stored as
their length, their first FIRST indices and an FNV-1a 64 checksum (over each index
as 8 little-endian bytes, in order), which the C++ test recomputes.
"""
import json
import sys

import torch
from torch.utils.data import DistributedSampler

MAX_FULL = 200
FIRST = 50
FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
MASK64 = (1 << 64) - 1


def fnv1a64(indices):
    h = FNV_OFFSET
    for x in indices:
        for b in (x & MASK64).to_bytes(8, "little"):
            h ^= b
            h = (h * FNV_PRIME) & MASK64
    return h


def encode(indices):
    if len(indices) <= MAX_FULL:
        return {"indices": indices}
    return {"count": len(indices), "first": indices[:FIRST], "fnv1a64": str(fnv1a64(indices))}


class Sized:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def sampler_case(n, world, rank, shuffle, seed, epoch, drop_last):
    s = DistributedSampler(Sized(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                           drop_last=drop_last)
    s.set_epoch(epoch)
    indices = list(iter(s))
    assert len(indices) == len(s)
    case = {"n": n, "num_replicas": world, "rank": rank, "shuffle": shuffle, "seed": seed,
            "epoch": epoch, "drop_last": drop_last, "size": len(s)}
    case.update(encode(indices))
    return case


def randperm_case(n, seed):
    g = torch.Generator()
    g.manual_seed(seed)
    case = {"n": n, "seed": seed}
    case.update(encode(torch.randperm(n, generator=g).tolist()))
    return case


def main():
    randperm = [randperm_case(n, seed)
                for n in (0, 1, 2, 3, 5, 10, 100, 1000, 100003, 1 << 20)
                for seed in (0, 42, 2**32 + 42, 2**63 + 5)]

    sampler = []
    for n in (0, 1, 2, 3, 10, 17, 60, 60000, 100003):
        large = n > MAX_FULL
        # Large datasets: the first and last rank of each world and fewer (seed, epoch) pairs,
        # to keep this file small.
        shuffles = ((0, 0), (0, 7), (42, 1)) if large else ((0, 0), (0, 1), (0, 7), (42, 0), (42, 1), (42, 7))
        for world in (1, 2, 3, 4):
            for rank in sorted({0, world - 1}) if large else range(world):
                for drop_last in (False, True):
                    sampler.append(sampler_case(n, world, rank, False, 0, 0, drop_last))
                    for seed, epoch in shuffles:
                        sampler.append(sampler_case(n, world, rank, True, seed, epoch, drop_last))
    # Seeds outside 0..2^32-1: torch takes seed + epoch modulo 2^64 (negative seeds wrap), and its
    # mt19937 keeps only the low 32 bits.
    for seed, epoch in ((-1, 0), (-1, 1), (-5, 3), (2**32 + 42, 0), (2**32 - 1, 1)):
        for rank in range(3):
            sampler.append(sampler_case(17, 3, rank, True, seed, epoch, False))

    out = sys.stdout
    out.write('{"torch_version": %s,\n' % json.dumps(torch.__version__))
    out.write(' "max_full": %d, "first": %d,\n' % (MAX_FULL, FIRST))
    for name, cases in (("randperm", randperm), ("sampler", sampler)):
        out.write(' "%s": [\n' % name)
        out.write(",\n".join("  " + json.dumps(c, separators=(",", ":")) for c in cases))
        out.write("\n ]%s\n" % ("," if name == "randperm" else ""))
    out.write("}\n")


if __name__ == "__main__":
    main()
