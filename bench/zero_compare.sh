#!/usr/bin/env bash
# Sharded data parallelism: cohort's ZeroOptimizer, FSDP and DDP vs PyTorch
# 2.13's ZeroRedundancyOptimizer, FSDP2 and DDP (gloo) on Fashion-MNIST, AdamW.
#   bench/zero_compare.sh [--reps 3] [--model mlp] [--steps 120] [--csv docs/perf/zero-np2.csv]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh" --peers
make -C "$root" build >/dev/null
exec /usr/bin/python3 "$root/bench/zero_compare.py" "$@"
