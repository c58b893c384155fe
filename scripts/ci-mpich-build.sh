#!/usr/bin/env bash
# CI's MPICH job: the mpi backend is written against the MPI standard, not Open
# MPI; this builds it against Debian's MPICH (installed beside Open MPI, which
# stays the default mpirun), warnings as errors in our files, and runs the
# mpi backend's suite under MPICH's mpiexec (Hydra).
#   scripts/ci-mpich-build.sh [build-dir]     (default: build-mpich)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh --mpich
dir=${1:-build-mpich}
jobs=${JOBS:-2}
echo "ci-mpich-build: $(/usr/bin/mpiexec.mpich --version | grep -m1 Version | tr -s ' '); building in $dir"
mkdir -p "$dir"
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release -DCOHORT_WITH_MPI=ON -DCOHORT_CUDA=OFF -DCOHORT_WITH_TORCH=OFF \
  -DCOHORT_WERROR=ON -DMPI_C_COMPILER=/usr/bin/mpicc.mpich -DMPI_CXX_COMPILER=/usr/bin/mpicxx.mpich \
  -DMPIEXEC_EXECUTABLE=/usr/bin/mpiexec.mpich | tee "$dir/configure.log" | grep "MPI backend" || true
grep -q "MPI_CXX_COMPILER_INCLUDE_DIRS:STRING=.*mpich" "$dir/CMakeCache.txt" ||
  { echo "ci-mpich-build: CMake did not take MPICH (see $dir/configure.log)" >&2; exit 1; }
cmake --build "$dir" -j "$jobs" --target mpi_backend_test mpi_coll_worker cohort_cli
(cd "$dir" && ctest -R 'Mpi' --output-on-failure --timeout 300 -j 1)
echo "ci-mpich-build: OK"
