#!/usr/bin/env bash
# CI's ThreadSanitizer job: the collectives, the DDP reducer and the store
# suites (the code built on futexes, lock-free rings, progress threads and
# memory shared across processes) built with -fsanitize=thread and run.
# Any race TSan reports fails the job (halt_on_error). No LibTorch, MPI or
# CUDA in this build: their libraries are not instrumented, and every report
# would be theirs. (`make tsan` runs the whole suite the same way, for a
# longer look.)
#   scripts/ci-tsan.sh [build-dir]        (default: build-tsan)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-tsan}
jobs=${JOBS:-$(nproc)}
suites=(collectives_test collective_checks_test shared_buffer_test
        ddp_bucket_plan_test ddp_grad_memory_test ddp_hooks_test ddp_reducer_test
        store_test store_tcp_test)
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
mkdir -p "$dir"
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCOHORT_SANITIZE=thread -DCOHORT_WITH_TORCH=OFF \
  -DCOHORT_WITH_MPI=OFF -DCOHORT_CUDA=OFF "${launcher[@]}" >"$dir/configure.log" 2>&1 ||
  { cat "$dir/configure.log"; exit 1; }
cmake --build "$dir" -j "$jobs" --target cohort_cli "${suites[@]}"
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 history_size=4 ${TSAN_OPTIONS:-}"
failed=()
for s in "${suites[@]}"; do
  start=$SECONDS
  filter=()
  # Ranks run as threads of one process here; 5 to 8 of them under TSan take
  # half the collective suite's 9 minutes and reach no code that 2-4 do not.
  [[ $s == collectives_test ]] && filter=(--gtest_filter='-*np5*:*np6*:*np7*:*np8*')
  if "$dir/tests/$s" --gtest_brief=1 "${filter[@]}" >"$dir/$s.log" 2>&1; then
    echo "ci-tsan: $s passed ($((SECONDS - start)) s)"
  else
    echo "ci-tsan: $s FAILED ($((SECONDS - start)) s); the end of its log:"
    tail -60 "$dir/$s.log"
    failed+=("$s")
  fi
done
if ((${#failed[@]})); then
  echo "ci-tsan: ${#failed[@]} suite(s) failed under ThreadSanitizer: ${failed[*]} (logs in $dir/)"
  exit 1
fi
echo "ci-tsan: all ${#suites[@]} suites clean under ThreadSanitizer"
