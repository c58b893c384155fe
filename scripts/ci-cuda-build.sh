#!/usr/bin/env bash
# CI's CUDA job: when the CUDA toolkit is installed (/usr/local/cuda/bin/nvcc),
# build libcohort and the CLI with the NCCL backend, warnings as errors in our
# files, and run the NCCL backend's test. Without a GPU that test checks the
# run-time detection (init with backend nccl fails with a clear error); with
# GPUs it runs the collectives. Without CUDA it says so and succeeds.
#   scripts/ci-cuda-build.sh [build-dir]     (default: build-cuda)
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc=/usr/local/cuda/bin/nvcc
if [[ ! -x $nvcc ]]; then
  echo "ci-cuda-build: skipped: no CUDA ($nvcc not found)"
  exit 0
fi
if [[ ! -f /usr/local/cuda/include/nccl.h && ! -f /usr/include/nccl.h ]]; then
  echo "ci-cuda-build: skipped: CUDA is installed but NCCL is not (no nccl.h in /usr/local/cuda/include or /usr/include)"
  exit 0
fi
dir=${1:-build-cuda}
jobs=${JOBS:-2}
echo "ci-cuda-build: $($nvcc --version | tail -1); building in $dir"
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release -DCOHORT_CUDA=ON -DCOHORT_WITH_TORCH=OFF -DCOHORT_WERROR=ON \
  -DCUDAToolkit_ROOT=/usr/local/cuda
cmake --build "$dir" -j "$jobs" --target cohort cohort_cli nccl_backend_test
"$dir/tests/nccl_backend_test"
echo "ci-cuda-build: OK"
