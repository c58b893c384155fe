#!/usr/bin/env bash
# A Python with PyTorch VERSION (the CPU wheel from PyPI) and numpy, in a
# virtual environment of its own, for the benchmarks' PyTorch peer
# (bench/ddp_scaling.py runs it beside Debian's python3-torch 1.13).
# Prints the environment's python. Idempotent.
#   scripts/install-pytorch-peer.sh [VERSION]     (default 2.13.0)
set -euo pipefail
version=${1:-2.13.0}
venv=${COHORT_LIBTORCH_HOME:-$HOME/.cache/cohort}/pytorch-$version
if "$venv/bin/python" -c "import torch, numpy, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
  echo "$venv/bin/python"
  exit 0
fi
echo "install-pytorch-peer: PyTorch $version into $venv" >&2
rm -rf "$venv"
python3 -m venv "$venv" >&2 || {
  echo "install-pytorch-peer: python3 -m venv failed; on Debian: apt-get install python3-venv" >&2
  exit 1
}
# On the project machines torch==VERSION resolves to the CPU wheel; elsewhere
# point pip at PyTorch's CPU index (PIP_INDEX_URL) first.
"$venv/bin/python" -m pip install --quiet "torch==$version" numpy >&2
echo "$venv/bin/python"
