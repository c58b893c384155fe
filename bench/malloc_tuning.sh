#!/usr/bin/env bash
# What `cohort run`'s malloc thresholds do to a plain LibTorch training loop
# (bench/torch_step_loop.cpp: no cohort inside): runs it under `cohort run`
# with the default (COHORT_MALLOC_TUNING=1) and without (=0), alternating.
#   bench/malloc_tuning.sh [--reps 3] [--steps 300]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
reps=3 steps=300
while [[ $# -gt 0 ]]; do
  case "$1" in
    --reps) reps=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    *) echo "malloc_tuning.sh: unknown argument '$1' (use --reps N, --steps N)" >&2; exit 2 ;;
  esac
done
make -C "$root" build >/dev/null
bin="$root/build/torch_step_loop"
[[ -x "$bin" ]] || { echo "malloc_tuning.sh: $bin was not built (LibTorch missing? scripts/install-deps.sh)" >&2; exit 1; }
echo "| rep | tuning | ms/step | page faults/step |"
echo "|---|---|---|---|"
for ((i = 1; i <= reps; i++)); do
  for tuning in 1 0; do
    line=$(env -u GLIBC_TUNABLES -u MALLOC_TRIM_THRESHOLD_ -u MALLOC_MMAP_THRESHOLD_ COHORT_MALLOC_TUNING=$tuning \
      OMP_NUM_THREADS=1 "$root/build/cohort" run --nproc-per-node 1 "$bin" "$steps" 2>&1 | grep "RESULT torch_step_loop")
    ms=$(sed -E 's/.*ms_per_step=([0-9.]+).*/\1/' <<< "$line")
    pf=$(sed -E 's/.*page_faults_per_step=([0-9.]+).*/\1/' <<< "$line")
    echo "| $i | $([[ $tuning == 1 ]] && echo on || echo off) | $ms | $pf |"
  done
done
