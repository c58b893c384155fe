#!/usr/bin/env bash
# One command that verifies cohort's GPU path on a machine with NVIDIA GPUs
# (docs/gpu.md). It builds cohort against the machine's own CUDA, NCCL and
# LibTorch (the CUDA PyTorch of `python3`), then runs, each step bounded by a
# timeout and logged to its own file under ./gpu-check-logs (where $OUT is
# set, as on the device machine, the logs go to /tmp and are packed into
# $OUT/gpu-check-logs.tar.gz after every step, since only a few files come back):
#   nccl       nccl_backend_test
#   ddp        tests/torch/ddp_cuda_test: DDP on CUDA tensors equal to one
#              process on the global batch (world 1 on nccl, world 2 sharing
#              the GPU on the native backend), the refusals
#   errors     bad input: more nccl ranks than GPUs, --device cuda with CUDA
#              hidden, --device cpu on nccl (each must fail, naming why)
#   accuracy   the example, 10 epochs on the GPU (world 1, nccl): test accuracy
#   zero       the example sharded on the GPU (world 1, nccl): --shard zero2
#              for 2 epochs with checkpoints (test accuracy), then resumed
#              under --shard zero1 for a third epoch (the sharded state saved
#              and loaded back into GPU memory)
#   fsdp       the example under --shard fsdp on the GPU (world 1, nccl):
#              each layer sharded onto the GPU as it is built, 2 epochs with
#              checkpoints (test accuracy), then resumed for a third epoch
#              with --cpu-offload (shards and the optimizer step on the host)
#   speed      images/s at world 1 on the GPU, same model, interleaved: cohort's
#              DDP with its reducer running (--reduce-at-world-size-1, as
#              PyTorch's DDP does at world 1), the same ordering the stream
#              after the allreduce instead of waiting on the host
#              (--ddp-wait-on-stream), cohort's default (a lone rank
#              skips the reduction), cohort without DDP (--no-ddp), and
#              PyTorch DDP (nccl)
#   timeline   a timeline of DDP reducing and of no DDP, 600 steps each (fails only
#              when a run or its trace does; the times are for reading, not judged)
#   bench      cohort bench --device cuda -c 1: every collective, then
#              allreduce in every dtype with sum, avg and max (0 wrong)
# and prints one summary table; exits non-zero if any step failed.
#
# Such a machine has no package registry: what the build needs beyond CUDA,
# NCCL, LibTorch, CMake and ninja (fmt, CLI11, nlohmann-json, hwloc,
# GoogleTest, and the Fashion-MNIST data) comes as Debian .deb files that
#   scripts/gpu-check.sh --prepare [DIR]     (default DIR: gpu-deps/)
# downloads on a development machine (Debian 12, apt). The check unpacks them
# into a private prefix. Run it with
#   scripts/gpu-check.sh [--deps DIR] [--quick] [--reps N] [--only STEP,...]
# (--quick: 2 epochs instead of 10 and shorter speed runs, one repetition;
# --reps: speed repetitions, 3 by default, after --quick if both are given;
# --only: just these steps, after the build).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEBS=(libfmt-dev libfmt9 nlohmann-json3-dev libcli11-dev libhwloc-dev libhwloc15 libgtest-dev libgmock-dev
      zlib1g-dev dataset-fashion-mnist)

if [[ ${1:-} == --prepare ]]; then
  set -e
  dir=${2:-gpu-deps}
  mkdir -p "$dir"
  (cd "$dir" && apt-get download "${DEBS[@]}")
  echo "gpu-check: $(ls "$dir"/*.deb | wc -l) packages in $dir ($(du -sh "$dir" | cut -f1)); carry that folder to the GPU machine"
  exit 0
fi

deps=gpu-deps
epochs=10
speed_steps=2500
speed_reps=3
only=
while [[ $# -gt 0 ]]; do
  case $1 in
    --deps) deps=$2; shift 2 ;;
    --quick) epochs=2; speed_steps=600; speed_reps=1; shift ;;
    --reps) speed_reps=${2:?--reps needs a number}; shift 2 ;;
    --only) o=${2:?--only needs STEP,...}; only=",${o// /},"; shift 2 ;;
    *) echo "gpu-check: unknown option $1 (use --prepare [DIR], --deps DIR, --quick, --reps N, --only STEP,...)" >&2
       exit 2 ;;
  esac
done
[[ $speed_reps =~ ^[1-9][0-9]*$ ]] || { echo "gpu-check: --reps wants a whole number >= 1, not '$speed_reps'" >&2; exit 2; }
steps=nccl,ddp,errors,accuracy,zero,fsdp,speed,timeline,bench
if [[ -n $only ]]; then
  IFS=, read -ra wanted_steps <<<"${only#,}"
  [[ ${#wanted_steps[@]} -gt 0 ]] || { echo "gpu-check: --only names no step (the steps: $steps)" >&2; exit 2; }
  for s in "${wanted_steps[@]}"; do
    [[ -n $s && ,$steps, == *,$s,* ]] || { echo "gpu-check: --only: no step '$s' (the steps: $steps; build always runs)" >&2; exit 2; }
  done
fi
# wanted STEP: whether --only (if given) names it.
wanted() { [[ -z $only || $only == *,$1,* ]]; }
if [[ -n ${OUT:-} ]]; then logs=${TMPDIR:-/tmp}/gpu-check-logs; rm -rf "$logs"; else logs=$ROOT/gpu-check-logs; fi
mkdir -p "$logs"
start=$(date +%s)
results=()  # "step|status|detail"
failed=0
pack() { [[ -z ${OUT:-} ]] || tar -czf "$OUT/gpu-check-logs.tar.gz" -C "$(dirname "$logs")" "$(basename "$logs")" 2>/dev/null || true; }
record() {
  results+=("$1|$2|$3"); [[ $2 == ok ]] || failed=1
  echo "gpu-check: $1: $2 ${3:+($3)} at $(($(date +%s) - start)) s"
  pack
}
# run STEP SECONDS CMD...: the command's output to $logs/STEP.log, bounded by a timeout.
run() {
  local step=$1 secs=$2; shift 2
  timeout -k 10 "$secs" "$@" >"$logs/$step.log" 2>&1
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$logs/gpu.txt" 2>/dev/null || true
gpu=$(head -1 "$logs/gpu.txt")
ngpu=$(grep -c . "$logs/gpu.txt"); [[ $ngpu -ge 1 ]] || ngpu=1
echo "gpu-check: GPU: ${gpu:-none found}"

# ---- the private prefix ----
prefix=${TMPDIR:-/tmp}/cohort-gpu-prefix
if ! ls "$deps"/*.deb >/dev/null 2>&1; then
  echo "gpu-check: no .deb files in $deps; run scripts/gpu-check.sh --prepare $deps on a Debian machine first" >&2
  exit 2
fi
rm -rf "$prefix" && mkdir -p "$prefix"
for d in "$deps"/*.deb; do dpkg-deb -x "$d" "$prefix" 2>/dev/null || dpkg -x "$d" "$prefix"; done
sed -i "s|^prefix=.*|prefix=$prefix/usr|" "$prefix"/usr/lib/x86_64-linux-gnu/pkgconfig/hwloc.pc
# zlib: the deb's header with the system's runtime library (the deb's libz.so
# points at a runtime that is not unpacked, and its static libz.a is not PIC).
rm -f "$prefix"/usr/lib/x86_64-linux-gnu/libz.so "$prefix"/usr/lib/x86_64-linux-gnu/libz.a
zlib=$(ls /usr/lib/x86_64-linux-gnu/libz.so.1 /lib/x86_64-linux-gnu/libz.so.1 2>/dev/null | head -1)
export PKG_CONFIG_PATH=$prefix/usr/lib/x86_64-linux-gnu/pkgconfig
export LD_LIBRARY_PATH=$prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
data=$prefix/usr/share/datasets/fashion-mnist

# ---- build against this machine's CUDA, NCCL and LibTorch ----
libtorch=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')
torch_version=$(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)')
nccl=$(python3 -c 'import importlib.util, os; s = importlib.util.find_spec("nvidia.nccl"); print(list(s.submodule_search_locations)[0])')
nccl_lib=$(ls "$nccl"/lib/libnccl.so* | head -1)
# LibTorch's CMake package finds CUDA with the old FindCUDA (nvcc on PATH or
# CUDA_TOOLKIT_ROOT_DIR) and needs libnvrtc, which a toolkit without the
# runtime-compilation component lacks: then take the one PyTorch's wheels carry.
cuda_root=/usr/local/cuda
nvrtc_args=()
if ! ls "$cuda_root"/lib64/libnvrtc.so* >/dev/null 2>&1; then
  nvrtc=$(python3 -c 'import glob, importlib.util as u; s = u.find_spec("nvidia"); print(next(iter(sorted(f for d in s.submodule_search_locations for f in glob.glob(d + "/*/lib/libnvrtc.so.*") if "builtins" not in f and ".alt." not in f)), ""))' 2>/dev/null)
  [[ -n $nvrtc ]] && nvrtc_args=(-DCUDA_nvrtc_LIBRARY="$nvrtc" -DCUDA_NVRTC_LIB="$nvrtc")
fi
# The GPU's own architecture, so that LibTorch's CMake need not compile a probe.
cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' ')
[[ -n $cap ]] && export TORCH_CUDA_ARCH_LIST=$cap
build=${TMPDIR:-/tmp}/cohort-gpu-build
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
if [[ -f $build/CMakeCache.txt ]] && ! grep -q "COHORT_LIBTORCH:PATH=$libtorch" "$build/CMakeCache.txt"; then rm -rf "$build"; fi
run configure 300 cmake -S . -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DCOHORT_CUDA=ON -DCOHORT_WITH_MPI=OFF \
  -DCUDAToolkit_ROOT="$cuda_root" -DCUDA_TOOLKIT_ROOT_DIR="$cuda_root" -DCOHORT_LIBTORCH="$libtorch" \
  -DCMAKE_PREFIX_PATH="$prefix/usr" -DNCCL_INCLUDE_DIR="$nccl/include" -DNCCL_LIBRARY="$nccl_lib" \
  -DZLIB_LIBRARY="$zlib" -DZLIB_INCLUDE_DIR="$prefix/usr/include" "${nvrtc_args[@]}"
if [[ $? -ne 0 ]]; then
  record build FAIL "configure: $logs/configure.log"
  tail -20 "$logs/configure.log"
  exit 1
fi
run build 420 cmake --build "$build" -j "$(nproc)" --target cohort_cli nccl_backend_test fashion_mnist ddp_cuda_test
if [[ $? -eq 0 ]]; then record build ok "LibTorch $torch_version, $(($(date +%s) - start)) s"; else record build FAIL "$logs/build.log"; fi
cohort=$build/cohort

if wanted nccl; then
# ---- the NCCL backend ----
run nccl 180 "$build/tests/nccl_backend_test"
if [[ $? -eq 0 ]]; then
  record nccl ok "$(grep -oE 'PASSED +\] [0-9]+' "$logs/nccl.log" | grep -oE '[0-9]+$') passed, $(grep -oE 'SKIPPED +\] [0-9]+' "$logs/nccl.log" | grep -oE '[0-9]+$' || echo 0) skipped"
else record nccl FAIL "$logs/nccl.log"; fi

fi

if wanted ddp; then
# ---- DDP on CUDA tensors ----
run ddp 240 "$build/tests/ddp_cuda_test"
if [[ $? -eq 0 ]] && ! grep -q SKIPPED "$logs/ddp.log"; then
  record ddp ok "$(grep -oE '[0-9]+ tests?' "$logs/ddp.log" | tail -1) passed, none skipped"
else record ddp FAIL "$logs/ddp.log"; fi

fi

if wanted errors; then
# ---- bad input: each must fail quickly and name the cause ----
errors_ok=1
# One rank more than there are GPUs (CUDA_VISIBLE_DEVICES unset: every rank sees them all).
(unset CUDA_VISIBLE_DEVICES; COHORT_BACKEND=nccl run err-two-ranks 90 "$cohort" run --nproc-per-node $((ngpu + 1)) \
  "$build/fashion_mnist" --device cuda --data-dir "$data" --max-steps 5)
if [[ $? -eq 0 ]] || ! grep -q "runs one process per GPU" "$logs/err-two-ranks.log"; then errors_ok=0; fi
CUDA_VISIBLE_DEVICES= run err-no-gpu 90 "$cohort" run --nproc-per-node 1 "$build/fashion_mnist" --device cuda \
  --data-dir "$data" --max-steps 5
if [[ $? -eq 0 ]] || ! grep -q "sees no CUDA GPU" "$logs/err-no-gpu.log"; then errors_ok=0; fi
COHORT_BACKEND=nccl run err-cpu-on-nccl 90 "$cohort" run --nproc-per-node 1 "$build/fashion_mnist" --device cpu \
  --data-dir "$data" --max-steps 5
if [[ $? -eq 0 ]] || ! grep -q "moves GPU memory only" "$logs/err-cpu-on-nccl.log"; then errors_ok=0; fi
if [[ $errors_ok -eq 1 ]]; then record errors ok "3 refusals named"; else record errors FAIL "$logs/err-*.log"; fi

fi

if wanted accuracy; then
# ---- accuracy: the example on the GPU ----
COHORT_BACKEND=nccl run accuracy 420 "$cohort" run --nproc-per-node 1 "$build/fashion_mnist" --device cuda \
  --data-dir "$data" --epochs "$epochs"
acc=$(sed -n 's/.*final test accuracy: \([0-9.]*\)%.*/\1/p' "$logs/accuracy.log" | tail -1)
if [[ -n $acc ]] && awk -v a="$acc" -v e="$epochs" 'BEGIN {exit !(e < 10 || a >= 91.6)}'; then
  record accuracy ok "$acc% after $epochs epochs"
else record accuracy FAIL "${acc:-no}% after $epochs epochs (want >= 91.6); $logs/accuracy.log"; fi

fi

# The example sharded on the GPU (world 1, nccl) for 2 epochs with
# checkpoints (the ranks agree on them over the nccl group's host_group()),
# then resumed to 3 epochs: step $1 is ok when a resume happened and both
# runs reach 88 % test accuracy. $2 and $3: the flags of the first run and of
# the resumed one (words, split here); $4: what the summary calls them.
train_and_resume() {
  local step=$1 what=$4 dir=$logs/$1-checkpoints first second a b
  read -ra first <<<"$2"
  read -ra second <<<"$3"
  rm -rf "$dir"
  COHORT_BACKEND=nccl run "$step-train" 300 "$cohort" run --nproc-per-node 1 "$build/fashion_mnist" --device cuda \
    --data-dir "$data" "${first[@]}" --epochs 2 --checkpoint-dir "$dir"
  a=$(sed -n 's/.*final test accuracy: \([0-9.]*\)%.*/\1/p' "$logs/$step-train.log" | tail -1)
  COHORT_BACKEND=nccl run "$step-resume" 300 "$cohort" run --nproc-per-node 1 "$build/fashion_mnist" --device cuda \
    --data-dir "$data" "${second[@]}" --epochs 3 --checkpoint-dir "$dir" --resume
  b=$(sed -n 's/.*final test accuracy: \([0-9.]*\)%.*/\1/p' "$logs/$step-resume.log" | tail -1)
  if [[ -n $a && -n $b ]] && grep -q "^resumed from" "$logs/$step-resume.log" &&
    awk -v a="$a" -v b="$b" 'BEGIN {exit !(a >= 88 && b >= 88)}'; then
    record "$step" ok "$what: 2 epochs $a%, resumed to 3 epochs $b%"
  else record "$step" FAIL "$what: ${a:-no}% after 2 epochs, resumed ${b:-no}% (want >= 88 each, and a resume); $logs/$step-*.log"; fi
}

# ZeRO: buckets, gradient shard and optimizer state in GPU memory; resumed under the other stage.
if wanted zero; then train_and_resume zero "--shard zero2" "--shard zero1" "zero2, resumed as zero1"; fi
# FSDP: shards, gathers and reductions in GPU memory; resumed with the shards offloaded to the host.
if wanted fsdp; then train_and_resume fsdp "--shard fsdp" "--shard fsdp --cpu-offload" "fsdp, resumed with --cpu-offload"; fi

# ---- speed at world 1: cohort DDP, cohort without DDP, PyTorch DDP ----
ips() { sed -n 's/.*RESULT ddp_summary .*imgs_per_s=\([0-9.]*\).*/\1/p' "$logs/$1.log" | tail -1; }
common=(--model cnn --epochs 3 --max-steps "$speed_steps" --augment none --lr 0.01 --weight-decay 0 --warmup-steps 0)
# median of the numbers on stdin (0 for none)
median_of() { sort -g | awk '{v[NR] = $1} END {print (NR == 0 ? 0 : NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2)}'; }
if wanted speed; then
# Interleaved repetitions: one run's rate moves by 10-30 % on a shared
# machine (the CPU launches this small CNN's kernels, and its speed varies),
# more than the differences measured here. DDP and no DDP run back to back in
# each repetition, and the verdict takes the median of their per-repetition
# ratios, which cancels what the two neighbouring runs share.
for rep in $(seq 1 "$speed_reps"); do
  COHORT_BACKEND=nccl run "speed-cohort-$rep" 240 "$cohort" run --nproc-per-node 1 "$build/fashion_mnist" \
    --device cuda --data-dir "$data" --reduce-at-world-size-1 "${common[@]}"
  COHORT_BACKEND=nccl run "speed-noddp-$rep" 240 "$cohort" run --nproc-per-node 1 "$build/fashion_mnist" \
    --device cuda --data-dir "$data" --no-ddp "${common[@]}"
  COHORT_BACKEND=nccl run "speed-stream-$rep" 240 "$cohort" run --nproc-per-node 1 "$build/fashion_mnist" \
    --device cuda --data-dir "$data" --reduce-at-world-size-1 --ddp-wait-on-stream "${common[@]}"
  COHORT_BACKEND=nccl run "speed-skip-$rep" 240 "$cohort" run --nproc-per-node 1 "$build/fashion_mnist" \
    --device cuda --data-dir "$data" "${common[@]}"
  run "speed-pytorch-$rep" 240 python3 -m torch.distributed.run --standalone --nproc_per_node 1 \
    bench/peers/torch_ddp_fmnist.py --device cuda --data-dir "$data" --model cnn --epochs 3 --max-steps "$speed_steps"
done
median() { for f in $(seq 1 "$speed_reps"); do ips "$1-$f"; done | grep . | median_of; }
# the median over repetitions of variant $1's rate over variant $2's in the same repetition
pair_median() {
  for f in $(seq 1 "$speed_reps"); do
    awk -v a="$(ips "$1-$f")" -v b="$(ips "$2-$f")" 'BEGIN {if (a > 0 && b > 0) printf "%.4f\n", a / b}'
  done | median_of
}
all_of() { local f out=""; for f in $(seq 1 "$speed_reps"); do out+="${out:+ }$(ips "$1-$f")"; done; echo "$out"; }
ours=$(median speed-cohort); noddp=$(median speed-noddp); torch_ips=$(median speed-pytorch); skip=$(median speed-skip)
stream=$(median speed-stream)
{
  echo "images/s per run (CNN, batch 64, world 1, $speed_steps steps):"
  for k in cohort noddp stream skip pytorch; do echo "  $k: $(all_of "speed-$k")"; done
} >"$logs/speed.txt"
cat "$logs/speed.txt"
vs_torch=$(pair_median speed-cohort speed-pytorch)
vs_noddp=$(pair_median speed-cohort speed-noddp)
stream_vs_noddp=$(pair_median speed-stream speed-noddp)
detail="medians of $speed_reps: cohort DDP (reducing) $ours img/s, the same waiting on the stream $stream, cohort default (lone rank skips) $skip, no DDP $noddp, PyTorch DDP $torch_ips; medians of the per-repetition ratios: ${vs_torch}x PyTorch, ${vs_noddp} of no-DDP (waiting on the stream: ${stream_vs_noddp})"
if awk -v t="$vs_torch" -v n="$vs_noddp" 'BEGIN {exit !(t >= 1.2 && n >= 0.95)}'; then record speed ok "$detail"
else record speed FAIL "$detail (want >= 1.2x and >= 0.95)"; fi
fi

# ---- where DDP's time goes at world 1: a timeline of each (the forward,
# backward and optimizer spans on the host), for docs/gpu.md; not a pass/fail step ----
if wanted timeline; then
timeline_ok=1
for k in cohort noddp; do
  flag=--reduce-at-world-size-1; [[ $k == noddp ]] && flag=--no-ddp
  COHORT_BACKEND=nccl COHORT_TIMELINE="$logs/timeline-$k" run "timeline-$k" 120 "$cohort" run --nproc-per-node 1 \
    "$build/fashion_mnist" --device cuda --data-dir "$data" $flag --model cnn --epochs 3 --max-steps 600 \
    --augment none --lr 0.01 --weight-decay 0 --warmup-steps 0 || timeline_ok=0
  [[ -s $logs/timeline-$k/rank0.json ]] || timeline_ok=0
done
if [[ $timeline_ok -eq 1 ]]; then record timeline ok "traces in timeline-cohort/ and timeline-noddp/ (no verdict)"
else record timeline FAIL "$logs/timeline-*.log"; fi
fi

# ---- every collective and dtype on the device, checked (last: the longest step,
# and what an earlier session already saw pass) ----
if wanted bench; then
bench_ok=1; rows=0
for coll in allreduce broadcast reduce allgather reduce_scatter alltoall gather scatter; do
  run "bench-$coll" 120 "$cohort" run --nproc-per-node 1 "$cohort" bench "$coll" --device cuda -b 8 -e 64M -f 16 -c 1 || bench_ok=0
done
for dt in half bf16 int8 uint8 int32 int64 double float; do
  for op in sum avg max; do
    run "bench-allreduce-$dt-$op" 60 "$cohort" run --nproc-per-node 1 "$cohort" bench allreduce --device cuda \
      -d "$dt" -o "$op" -b 8 -e 16M -f 16 -c 1 || bench_ok=0
  done
done
wrong=$(cat "$logs"/bench-*.log | sed 's/^\[rank[0-9]*\]: //' | awk '/^ *[0-9]+ / {n++; if ($NF != 0) w++} END {print (w+0) "/" (n+0)}')
rows=${wrong#*/}
if [[ $bench_ok -eq 1 && ${wrong%/*} -eq 0 && $rows -gt 0 ]]; then record bench ok "$rows rows, 0 wrong"
else record bench FAIL "wrong rows ${wrong}; $logs/bench-*.log"; fi
fi

# ---- summary ----
{
  echo
  echo "cohort gpu-check, $(date -u +%Y-%m-%dT%H:%MZ), GPU: ${gpu:-?}, LibTorch/CUDA: $torch_version, $(($(date +%s) - start)) s"
  printf '%-9s %-5s %s\n' step result detail
  for r in "${results[@]}"; do IFS='|' read -r s st d <<<"$r"; printf '%-9s %-5s %s\n' "$s" "$st" "$d"; done
} | tee "$logs/summary.txt"
[[ -z ${OUT:-} ]] || cp "$logs/summary.txt" "$OUT/"
pack
exit $failed
