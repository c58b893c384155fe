#!/usr/bin/env bash
# CI's CUDA job: when the CUDA toolkit is installed (/usr/local/cuda/bin/nvcc),
# build libcohort and the CLI with the NCCL backend, and the LibTorch adapter
# and the example against LibTorch 2.x (the adapter uses device-generic c10
# APIs only, so a CPU LibTorch builds the same code that runs CUDA modules:
# docs/gpu.md), warnings as errors in our files, and run the NCCL backend's
# test. Without a GPU that test checks the run-time detection (init with
# backend nccl fails with a clear error); with GPUs it runs the collectives.
# NCCL comes from the system (nccl.h in /usr/local/cuda/include or
# /usr/include) or else from the nvidia-nccl-cuNN wheel on PyPI (NN: the
# toolkit's CUDA major version), installed
# outside any Python environment. Without CUDA it says so and succeeds.
#   scripts/ci-cuda-build.sh [build-dir]     (default: build-cuda)
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc=/usr/local/cuda/bin/nvcc
if [[ ! -x $nvcc ]]; then
  echo "ci-cuda-build: skipped: no CUDA ($nvcc not found)"
  exit 0
fi
dir=${1:-build-cuda}
jobs=${JOBS:-$(nproc)}
nccl_args=()
if [[ ! -f /usr/local/cuda/include/nccl.h && ! -f /usr/include/nccl.h ]]; then
  # The wheel built for this toolkit's CUDA major version (nvidia-nccl-cu12, -cu13, ...).
  cuda_major=$($nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
  nccl_version=${COHORT_NCCL_WHEEL_VERSION:-2.30.7}
  nccl=${COHORT_LIBTORCH_HOME:-$HOME/.cache/cohort}/nccl-cu$cuda_major-$nccl_version
  if [[ ! -f $nccl/nvidia/nccl/include/nccl.h ]]; then
    echo "ci-cuda-build: NCCL not installed; fetching nvidia-nccl-cu$cuda_major==$nccl_version into $nccl"
    rm -rf "$nccl.partial"
    python3 -m pip install --quiet --no-deps --no-compile --target "$nccl.partial" "nvidia-nccl-cu$cuda_major==$nccl_version"
    rm -rf "$nccl" && mv "$nccl.partial" "$nccl"
  fi
  lib=$(ls "$nccl"/nvidia/nccl/lib/libnccl.so* | head -1)
  nccl_args=(-DNCCL_INCLUDE_DIR="$nccl/nvidia/nccl/include" -DNCCL_LIBRARY="$lib")
fi
libtorch=$(scripts/install-libtorch.sh)
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
echo "ci-cuda-build: $($nvcc --version | tail -1); LibTorch at $libtorch; building in $dir"
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release -DCOHORT_CUDA=ON -DCOHORT_WERROR=ON \
  -DCUDAToolkit_ROOT=/usr/local/cuda -DCOHORT_LIBTORCH="$libtorch" "${nccl_args[@]}" "${launcher[@]}"
cmake --build "$dir" -j "$jobs" --target cohort cohort_cli nccl_backend_test cohort_torch fashion_mnist
"$dir/tests/nccl_backend_test"
echo "ci-cuda-build: OK"
