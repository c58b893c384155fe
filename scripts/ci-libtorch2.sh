#!/usr/bin/env bash
# CI's LibTorch 2.x job: builds the LibTorch adapter, the example and the
# torch test suite against LibTorch 2.x (the CPU wheel, scripts/install-libtorch.sh)
# and runs that suite (ctest -L torch). `make test` covers Debian's 1.13.
#   scripts/ci-libtorch2.sh [build-dir] [version]     (default: build-torch2, 2.13.0)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-torch2}
version=${2:-2.13.0}
jobs=${JOBS:-$(nproc)}
libtorch=$(scripts/install-libtorch.sh "$version")
echo "ci-libtorch2: LibTorch $version at $libtorch; building in $dir"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
mkdir -p "$dir"
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release -DCOHORT_LIBTORCH="$libtorch" "${launcher[@]}" >"$dir/configure.log" 2>&1 ||
  { cat "$dir/configure.log"; exit 1; }
grep "cohort: LibTorch" "$dir/configure.log"
targets=$(sed -n 's/^\([a-z_0-9]*_test\)\.cpp$/\1/p' <(ls tests/torch))
cmake --build "$dir" -j "$jobs" --target cohort_cli fashion_mnist $targets
cd "$dir" && ctest -L torch --output-on-failure --timeout 900 -j 1
