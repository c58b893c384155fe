#!/usr/bin/env bash
# DDP scaling: cohort vs PyTorch DDP (gloo) on Fashion-MNIST, CNN and MLP.
#   bench/ddp_scaling.sh [--reps 3] [--models cnn,mlp] [--csv docs/perf/ddp-scaling.csv]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh" --peers
make -C "$root" build >/dev/null
exec /usr/bin/python3 "$root/bench/ddp_scaling.py" "$@"
