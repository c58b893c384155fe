#!/usr/bin/env bash
# ctest install_find_package: installs the build tree into a temporary prefix,
# builds tests/install/ (a separate project) against it with find_package(cohort),
# and runs its allreduce on 2 ranks under the installed `cohort run`.
#   tests/install/run.sh BUILD_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
# Nothing of the source tree is visible: only the prefix.
test -f "$work/prefix/include/cohort/process_group.hpp"
if ls "$work/prefix/include" | grep -qv '^cohort$'; then echo "the prefix holds headers outside include/cohort/"; exit 1; fi
cmake -S "$src" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release > "$work/configure.log" ||
  { cat "$work/configure.log"; exit 1; }
cmake --build "$work/consumer" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
out=$("$work/prefix/bin/cohort" run --standalone --nproc-per-node 2 "$work/consumer/allreduce_consumer")
echo "$out"
grep -q "rank 0 of 2: allreduce sum 3" <<<"$out"
grep -q "rank 1 of 2: allreduce sum 3" <<<"$out"
# The library exports the public API, not the tree under src/.
if nm -DC --defined-only "$work/prefix/lib"*/libcohort.so | grep -m5 -E 'cohort::(core|group|transport|collectives|store|launch|topo|checkpoint)::'; then
  echo "libcohort.so exports internal symbols (above); mark only include/cohort/ declarations COHORT_API"
  exit 1
fi
echo "install_find_package: ok"
