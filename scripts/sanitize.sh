#!/usr/bin/env bash
# Builds the CPU-only tree under AddressSanitizer + UndefinedBehaviorSanitizer
# (build-asan) and ThreadSanitizer (build-tsan) and runs the service, core and
# client tests in each. Any finding fails the test that hit it.
#   scripts/sanitize.sh [asan|tsan]...   (default: both)
# Suppressions (scripts/sanitizers/*.supp) cover only findings inside
# libraries we do not build (gRPC, protobuf, OpenBLAS), each with its reason.
# The tsan build links tools/sanitizers' fs_tsan_absl into every binary so
# that ThreadSanitizer sees Debian's (uninstrumented) absl::Mutex, CondVar and
# Notification; tsan_absl_shim_test checks that it does.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
kinds=("$@")
if [ ${#kinds[@]} -eq 0 ]; then kinds=(asan tsan); fi
jobs=${FS_JOBS:-2}
labels=${FS_SANITIZE_LABELS:-service|core|client}
status=0
launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
for kind in "${kinds[@]}"; do
  case "$kind" in
    asan) sanitize=address,undefined ;;
    tsan) sanitize=thread ;;
    *) echo "unknown sanitizer build '$kind' (asan or tsan)" >&2; exit 2 ;;
  esac
  dir=build-$kind
  # Warnings stay warnings here: with ASan's instrumentation GCC 12 reports
  # std::regex's std::function members as maybe-uninitialized (inside
  # libstdc++), which -Werror would turn into a failed build.
  cmake -S . -B "$dir" -DFS_CUDA=OFF -DFS_WERROR=OFF \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFS_SANITIZE="$sanitize" "${launcher[@]}"
  cmake --build "$dir" -j"$jobs"
  # handle_sigbus=0: the daemon handles SIGBUS itself (a shared-memory copy
  # that faults fails its request; any other SIGBUS must still kill it, as
  # shared_memory_test checks), and a sanitizer's handler would take it.
  export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=1:handle_sigbus=0"
  export LSAN_OPTIONS="suppressions=$root/scripts/sanitizers/lsan.supp:print_suppressions=0"
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
  export TSAN_OPTIONS="suppressions=$root/scripts/sanitizers/tsan.supp:halt_on_error=1:second_deadlock_stack=1:handle_sigbus=0"
  echo "== $kind: ctest -L '$labels'"
  if ! ctest --test-dir "$dir" -L "$labels" -j"$jobs" --output-on-failure; then
    status=1
  fi
done
exit $status
