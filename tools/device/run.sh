#!/usr/bin/env bash
# Runs ON the GPU machine, from the repository root with .device_bundle/
# (made by tools/device/bundle.sh) beside it: the GPU tests (gtest XML),
# compute-sanitizer memcheck + racecheck on a small case, and fs_bench (CSV
# and a PNG plot), everything logged to <outdir>/run.log; a short summary
# table is printed last.
#
#   tools/device/run.sh <outdir> [tests|bench|all]
#
# The bench also runs fs_controls_bench (FS_CONTROLS_BENCH=0 skips it),
# fs_engine_bench where the bundle has it (FS_ENGINE_BENCH=0 skips it) and
# times the fused / cuBLAS pair at B = 128 and 256 again with
# 1000 calls per method (results_steady.csv; FS_BENCH_STEADY=0 skips it):
# there every method runs at the GPU's power cap, and a 100-call median moves
# with its place in the run (docs/performance.md#how-the-kernel-is-measured).
# Then batches
# between the powers of two, without the sweep (results_between.csv;
# FS_BENCH_BETWEEN=0 skips it).
set -uo pipefail
if (($# < 1)); then
  echo "usage: $0 <outdir> [tests|bench|all]" >&2
  exit 2
fi
out=$1
mode=${2:-all}
root=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=tools/device/env.sh
source "$root/tools/device/env.sh"
fs_device_env "${FS_BUNDLE_DIR:-$root/.device_bundle}" || exit 1
bundle=$FS_BUNDLE
mkdir -p "$out"
log=$out/run.log
: >"$log"


say() { echo "$@" | tee -a "$log"; }
summary=()

say "== $(date -u +%Y-%m-%dT%H:%M:%SZ) tools/device/run.sh $mode"
nvidia-smi -L 2>&1 | tee -a "$log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv 2>&1 | tee -a "$log"
say "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
if command -v cuobjdump >/dev/null; then
  say "SASS of fs_bench: $(cuobjdump --dump-sass "$bundle/bin/fs_bench" 2>/dev/null | grep -c HGMMA) HGMMA, $(cuobjdump --dump-sass "$bundle/bin/fs_bench" 2>/dev/null | grep -c HMMA) HMMA instructions"
fi

run_test() {  # name, extra gtest args...
  local name=$1
  shift
  say "== $name"
  timeout "${FS_TEST_TIMEOUT:-300}" "$bundle/bin/$name" \
    --gtest_output="xml:$out/$name.xml" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  local counts
  counts=$(grep -o 'tests="[0-9]*" failures="[0-9]*" disabled="[0-9]*" errors="[0-9]*"' "$out/$name.xml" 2>/dev/null | head -1)
  local skipped
  skipped=$(grep -c '<skipped' "$out/$name.xml" 2>/dev/null)
  summary+=("$(printf '%-28s rc=%-3s %s skipped=%s' "$name" "$rc" "$counts" "${skipped:-?}")")
}

run_sanitizer() {  # tool, binary, filter
  local tool=$1 binary=$2 filter=$3
  say "== compute-sanitizer --tool $tool $binary --gtest_filter=$filter"
  timeout "${FS_SANITIZER_TIMEOUT:-150}" compute-sanitizer --tool "$tool" \
    --error-exitcode 99 \
    "$bundle/bin/$binary" --gtest_filter="$filter" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  local errors
  errors=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1)
  summary+=("$(printf '%-28s rc=%-3s %s' "sanitizer $tool $binary" "$rc" "$errors")")
}

if [[ $mode == tests || $mode == all ]]; then
  run_test fused_sampler_gpu_test
  run_test cuda_engine_gpu_test
  run_test controlled_sampler_gpu_test
  run_test controls_stats_gpu_test
  # A trapping kernel poisons its process: this one runs alone.
  run_test cuda_fault_gpu_test
  if command -v compute-sanitizer >/dev/null; then
    small='*SanitizerSmallCase*:*ReduceCandidates*:*SplitLastRound*'
    run_sanitizer memcheck fused_sampler_gpu_test "$small"
    run_sanitizer racecheck fused_sampler_gpu_test "$small"
    run_sanitizer memcheck cuda_engine_gpu_test '*TokensEqualTheCpuSampler*:*GraphReplays*'
    # The controlled sampler's kernels (candidate path, full passes, the
    # pending rows' merge).
    run_sanitizer memcheck controlled_sampler_gpu_test '*V129*:*V1000*:*Pending*'
    run_sanitizer racecheck controlled_sampler_gpu_test '*V129*:*V1000*:*Pending*'
    # The engine's controlled paths with rows of five kinds in one batch.
    run_sanitizer memcheck controls_stats_gpu_test '*RowsWithDifferentControls*/V129'
  else
    summary+=("compute-sanitizer not found: sanitizer runs SKIPPED")
  fi
fi

if [[ $mode == bench || $mode == all ]]; then
  say "== fs_bench"
  # shellcheck disable=SC2086  # FS_BENCH_ARGS is a list of flags
  timeout "${FS_BENCH_TIMEOUT:-300}" "$bundle/bin/fs_bench" --out "$out" \
    ${FS_BENCH_ARGS:-} 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  summary+=("$(printf '%-28s rc=%s' fs_bench "$rc")")
  if ((rc != 0)); then
    # A broken wgmma path must not cost the baselines: measure again on the
    # portable path alone.
    say "== fs_bench failed (rc=$rc); again with --path mma"
    timeout "${FS_BENCH_TIMEOUT:-300}" "$bundle/bin/fs_bench" --out "$out" \
      --path mma ${FS_BENCH_ARGS:-} 2>&1 | tee -a "$log"
    summary+=("$(printf '%-28s rc=%s' "fs_bench --path mma" "${PIPESTATUS[0]}")")
  fi
  if [[ -f $out/results.csv ]]; then
    python3 "$bundle/plot_bench.py" "$out/results.csv" "$out/bench.png" 2>&1 | tee -a "$log"
  fi
  if [[ ${FS_CONTROLS_BENCH:-1} != 0 ]]; then
    # The sampling controls against the plain fused sampler and cuBLAS +
    # the same exact sampler (results_controls.csv).
    say "== fs_controls_bench"
    timeout "${FS_BENCH_TIMEOUT:-300}" "$bundle/bin/fs_controls_bench" \
      --out "$out" ${FS_CONTROLS_BENCH_ARGS:-} 2>&1 | tee -a "$log"
    summary+=("$(printf '%-28s rc=%s' fs_controls_bench "${PIPESTATUS[0]}")")
  fi
  if [[ ${FS_ENGINE_BENCH:-1} != 0 && -x $bundle/bin/fs_engine_bench ]]; then
    # One batch in the CUDA engine, host included, for each mix of
    # controls against the plain batch (results_engine.csv).
    say "== fs_engine_bench"
    timeout "${FS_BENCH_TIMEOUT:-300}" "$bundle/bin/fs_engine_bench" \
      --out "$out" --iters 40 --warmup 8 2>&1 | tee -a "$log"
    summary+=("$(printf '%-28s rc=%s' fs_engine_bench "${PIPESTATUS[0]}")")
  fi
  if [[ ${FS_BENCH_STEADY:-1} != 0 ]]; then
    say "== fs_bench, steady state: 1000 calls per method at B = 128 and 256"
    steady=$(mktemp -d)
    timeout "${FS_BENCH_TIMEOUT:-300}" "$bundle/bin/fs_bench" --out "$steady" \
      --batches 128,256 --no-sweep --iters 1000 --warmup 100 2>&1 | tee -a "$log"
    summary+=("$(printf '%-28s rc=%s' "fs_bench steady state" "${PIPESTATUS[0]}")")
    # Only the summary comes back: the device tool returns at most 8 files.
    if [[ -f $steady/results.csv ]]; then
      cp "$steady/results.csv" "$out/results_steady.csv"
    fi
  fi
  if [[ ${FS_BENCH_BETWEEN:-1} != 0 ]]; then
    # The sweep's batches are powers of two; a decode step's batch is any
    # size, and a partial batch tile has its own costs (docs/performance.md).
    say "== fs_bench, batches between the powers of two"
    between=$(mktemp -d)
    timeout "${FS_BENCH_TIMEOUT:-300}" "$bundle/bin/fs_bench" --out "$between" \
      --batches 3,24,40,100,136,160,192,224 --no-sweep 2>&1 | tee -a "$log"
    summary+=("$(printf '%-28s rc=%s' "fs_bench between" "${PIPESTATUS[0]}")")
    if [[ -f $between/results.csv ]]; then
      cp "$between/results.csv" "$out/results_between.csv"
    fi
  fi
fi

# The fused / cuBLAS columns of a results.csv, under a title (nothing when
# the file is missing).
ratio_table() {  # title, csv
  [[ -f $2 ]] || return 0
  echo
  echo "$1"
  echo "config    B  fused_us  cublas_us  fused/cublas  cublas_first  interleaved"
  awk -F, 'NR > 1 { printf "%-7s %4d %9.1f %10.1f %13.3f %13.3f %12.3f\n", $1, $4, $6, $7, $10, $18, $17 }' "$2"
}

{
  echo
  echo "== summary ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))"
  for line in "${summary[@]}"; do echo "$line"; done
  if [[ -f $out/results.csv ]]; then
    echo
    echo "config    B  path    fused_us  cublas_us  fused/cublas  cublas_first  interleaved  best_variant        best/cublas  W_TB/s  stream_TB/s  W/stream  softmax+multi_us  gumbel_us"
    awk -F, 'NR > 1 { printf "%-7s %4d  %-6s %9.1f %10.1f %12.3f %13.3f %12.3f  %-18s %11.3f %7.2f %12.2f %9.3f %17.1f %10.1f\n", $1, $4, $5, $6, $7, $10, $18, $17, $11, $13, $14, $15, $16, $8, $9 }' "$out/results.csv"
  fi
  ratio_table "steady state (1000 calls per method)" "$out/results_steady.csv"
  ratio_table "batches between the powers of two (100 calls per method)" \
    "$out/results_between.csv"
} | tee -a "$log"
