#!/usr/bin/env bash
# Installs the Debian packages cohort needs, only those that are missing.
# Idempotent and quiet when everything is present.
#   scripts/install-deps.sh          build + test dependencies (Open MPI included: the mpi backend)
#   scripts/install-deps.sh --peers  also the peer systems used by bench/compare_peers.sh
#   scripts/install-deps.sh --mpich  also MPICH (beside Open MPI, which stays the default): scripts/ci-mpich-build.sh
set -euo pipefail

pkgs=(cmake make g++ pkg-config libcli11-dev libfmt-dev nlohmann-json3-dev
      libgtest-dev libgmock-dev libhwloc-dev zlib1g-dev iproute2 procps
      python3   # tests/*.py, scripts/check_layers.py (ctest check_layers)
      libtorch-dev libopenblas0-pthread dataset-fashion-mnist
      fortunes   # the English text examples/gpt trains on
      clang libclang-rt-dev   # clang + libFuzzer: fuzz/ (the fuzz_* ctests skip without them)
      openmpi-bin libopenmpi-dev)   # the mpi backend and its tests (docs/mpi.md)
for arg in "$@"; do
  case "$arg" in
    --peers) pkgs+=(python3-torch python3-numpy) ;;
    --mpich) pkgs+=(mpich libmpich-dev) ;;
    *) echo "install-deps: unknown option $arg (use --peers and/or --mpich)" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${pkgs[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

echo "install-deps: installing ${missing[*]}"
SUDO=""
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "install-deps: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
  SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
