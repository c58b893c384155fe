#!/usr/bin/env bash
# Runs cohort and the peers (Open MPI shm and tcp, PyTorch gloo) side by side.
#   bench/compare_peers.sh [--coll allreduce] [--reps 3] [--np 2] [--no-gloo] [--with-mpi-backend] [--only-mpi] [--shared-buffers] [--with-spin] [--csv docs/perf/X.csv]
# Installs the peers (Debian's openmpi-bin, python3-torch) if missing, builds
# cohort and the MPI benchmark, then prints a markdown table (docs/performance.md).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh" --peers
make -C "$root" build >/dev/null
mkdir -p "$root/bench/peers/bin"
if [[ ! -x "$root/bench/peers/bin/mpi_allreduce" || "$root/bench/peers/mpi_allreduce.c" -nt "$root/bench/peers/bin/mpi_allreduce" ]]; then
  mpicc -O2 -o "$root/bench/peers/bin/mpi_allreduce" "$root/bench/peers/mpi_allreduce.c"
fi
exec /usr/bin/python3 "$root/bench/compare_peers.py" --cohort "$root/build/cohort" "$@"
