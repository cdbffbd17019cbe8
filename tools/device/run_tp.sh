#!/usr/bin/env bash
# Runs the tensor-parallel GPU tests (tp_gpu_test) and benchmark (fs_tp_bench)
# on a multi-GPU device machine from a prebuilt bundle, writes logs and CSV to
# an output folder, and prints a summary table.
#
# usage: tools/device/run_tp.sh [BUNDLE_DIR] [OUT_DIR]
#   BUNDLE_DIR  .device_bundle (the archive, unpacked by tools/device/env.sh)
#               or an unpacked bundle (bin/, lib/); default .device_bundle
#   OUT_DIR     where tp_device.log, tp_gpu_test.log and tp_bench.csv go;
#               default $OUT, else ./tp_out
# Environment knobs: TP_TEST_TIMEOUT (s, default 360), TP_BENCH_TIMEOUT (s,
# default 200), TP_BENCH_ARGS (extra fs_tp_bench flags), TP_GTEST_FILTER.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1

out=${2:-${OUT:-./tp_out}}
# shellcheck source=tools/device/env.sh
source tools/device/env.sh
fs_device_env "${1:-.device_bundle}" || exit 1
bundle=$FS_BUNDLE
mkdir -p "$out"
log="$out/tp_device.log"
: >"$log"

find_bin() {
  find "$bundle" -maxdepth 3 -type f -name "$1" -perm -u+x 2>/dev/null | head -n 1
}
test_bin=$(find_bin tp_gpu_test)
bench_bin=$(find_bin fs_tp_bench)

{
  echo "== tools/device/run_tp.sh $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "bundle=$bundle out=$out"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  env | grep -E '^(NCCL_NVLS_ENABLE|NVSHMEM_DISABLE_NVLS|TORCH_SYMM_MEM_DISABLE_MULTICAST)='
  nvidia-smi -L 2>&1
  nvidia-smi topo -m 2>&1
  for b in "$test_bin" "$bench_bin"; do
    [[ -n "$b" ]] || continue
    echo "-- ldd $b"
    ldd "$b" 2>&1 | grep -E 'nccl|cublas|cudart|not found'
  done
} >>"$log" 2>&1

status=0
test_result="NOT RUN (tp_gpu_test not in $bundle)"
if [[ -n "$test_bin" ]]; then
  filter=${TP_GTEST_FILTER:-*}
  timeout "${TP_TEST_TIMEOUT:-360}" "$test_bin" --gtest_filter="$filter" \
    >"$out/tp_gpu_test.log" 2>&1
  rc=$?
  passed=$(grep -c '^\[       OK \]' "$out/tp_gpu_test.log")
  failed=$(grep -c '^\[  FAILED  \] .*(' "$out/tp_gpu_test.log")
  skipped=$(grep -c '^\[  SKIPPED \] .*(' "$out/tp_gpu_test.log")
  test_result="rc=$rc passed=$passed failed=$failed skipped=$skipped"
  ((rc == 124)) && test_result="$test_result (TIMED OUT)"
  ((rc != 0)) && status=1
fi

bench_result="NOT RUN (fs_tp_bench not in $bundle)"
csv="$out/tp_bench.csv"
if [[ -n "$bench_bin" ]]; then
  # Even halves at every batch size, then the 60/40 split (uneven shards).
  timeout "${TP_BENCH_TIMEOUT:-200}" "$bench_bin" --csv="$out/tp_bench_even.csv" \
    ${TP_BENCH_ARGS:-} >>"$log" 2>&1
  rc_even=$?
  timeout "${TP_BENCH_TIMEOUT:-200}" "$bench_bin" --split=60:40 \
    --batches=16,256 --csv="$out/tp_bench_60_40.csv" ${TP_BENCH_ARGS:-} \
    >>"$log" 2>&1
  rc_uneven=$?
  # One CSV back (the device tool returns few files): even rows, then 60/40.
  {
    cat "$out/tp_bench_even.csv" 2>/dev/null
    tail -n +2 "$out/tp_bench_60_40.csv" 2>/dev/null
  } >"$csv"
  rm -f "$out/tp_bench_even.csv" "$out/tp_bench_60_40.csv"
  bench_result="rc_even=$rc_even rc_60_40=$rc_uneven"
  ((rc_even != 0 || rc_uneven != 0)) && status=1
fi

summary() {
  echo
  echo "================ tensor parallel: summary ================"
  echo "tp_gpu_test : $test_result"
  echo "fs_tp_bench : $bench_result"
  if [[ -f "$out/tp_gpu_test.log" ]]; then
    grep -E '^\[  FAILED  \] .*\(' "$out/tp_gpu_test.log" | head -n 20
  fi
  if [[ -s "$csv" ]]; then
    echo
    # Targets: TP2 fused >= 1.85x TP1 fused and <= 0.70x of the
    # TP2 all-gather baseline, at every B; fused tokens equal TP1's.
    awk -F, 'NR > 1 {
        mode = $4; split_ = $9; b = $6; us = $12; x = $14; ag = $15; mm = $16
        verdict = ""
        if (mode ~ /_fused_/ && split_ == "even") {
          verdict = (x >= 1.85 ? "x>=1.85 ok" : "x<1.85 MISS")
          verdict = verdict (ag > 0 && ag <= 0.70 ? ", ag<=0.70 ok" : ", ag>0.70 MISS")
          verdict = verdict (mm == 0 ? ", tokens=tp1" : ", TOKENS DIFFER")
        }
        printf "%-24s %-6s %5s %10s %8s %8s %6s  %s\n", mode, split_, b, us, x, ag, mm, verdict
      }
      NR == 1 { printf "%-24s %-6s %5s %10s %8s %8s %6s\n", "mode", "split", "B", "us_min", "x_tp1", "vs_ag", "mism" }' "$csv"
  fi
  echo "logs: $log $out/tp_gpu_test.log; csv: $csv"
}
summary | tee -a "$log"
exit $status
