#!/usr/bin/env bash
# Installs LibTorch from PyTorch's wheel on PyPI (the CPU build; its torch/
# folder holds LibTorch's headers, shared libraries and CMake package) into
#   ${COHORT_LIBTORCH_HOME:-$HOME/.cache/cohort}/libtorch-VERSION/torch
# and prints that folder, for cmake -DCOHORT_LIBTORCH=... Idempotent.
#   scripts/install-libtorch.sh [VERSION]     (default 2.13.0)
# A LibTorch zip from pytorch.org works the same way: unpack it and pass its
# libtorch/ folder as COHORT_LIBTORCH (README "Which LibTorch").
set -euo pipefail
version=${1:-2.13.0}
home=${COHORT_LIBTORCH_HOME:-$HOME/.cache/cohort}
dest=$home/libtorch-$version
if [[ -f $dest/torch/share/cmake/Torch/TorchConfig.cmake ]]; then
  echo "$dest/torch"
  exit 0
fi
py=$(command -v python3 || true)
if [[ -z $py ]] || ! "$py" -m pip --version >/dev/null 2>&1; then
  echo "install-libtorch: python3 with pip is needed to fetch the torch wheel; installing python3-pip" >&2
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends python3 python3-pip >/dev/null
  py=$(command -v python3)
fi
echo "install-libtorch: installing LibTorch $version (the torch==$version wheel, CPU) into $dest" >&2
rm -rf "$dest.partial"
mkdir -p "$home"
# --target installs outside any Python environment; --no-deps: LibTorch needs
# none of the wheel's Python dependencies.
"$py" -m pip install --quiet --no-deps --no-compile --target "$dest.partial" "torch==$version" >&2
if [[ ! -f $dest.partial/torch/share/cmake/Torch/TorchConfig.cmake ]]; then
  echo "install-libtorch: the torch==$version wheel has no share/cmake/Torch (not a LibTorch)" >&2
  exit 1
fi
# PyPI's default torch for Linux is a CUDA build whose CUDA libraries come as
# other wheels (not installed here: --no-deps), so it would not link.
if ls "$dest.partial"/torch/lib/libtorch_cuda.so >/dev/null 2>&1; then
  rm -rf "$dest.partial"
  echo "install-libtorch: pip gave the CUDA build of torch==$version; point pip at PyTorch's CPU wheels" \
       "(PIP_INDEX_URL) and run this again, or pass a CUDA LibTorch you unpacked as -DCOHORT_LIBTORCH" >&2
  exit 1
fi
rm -rf "$dest"
mv "$dest.partial" "$dest"
echo "$dest/torch"
