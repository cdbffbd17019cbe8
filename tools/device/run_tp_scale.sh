#!/usr/bin/env bash
# Runs ON a GPU machine with 4 or 8 GPUs, from a bundle:
# tp_gpu_test (its one-rank-per-GPU cases run where that many GPUs exist, the
# others skip loudly) and fs_tp_bench at TP = 4 and, with 8 GPUs, TP = 8, for
# V=128256, D=8192 and V=151936, D=4096, B in {1, 16, 64, 256}, min over 5 runs
# of 100 calls. Prints the scaling targets' verdicts last.
#
#   tools/device/run_tp_scale.sh .device_bundle <outdir>   # or an unpacked bundle
set -uo pipefail
out=${2:?output dir}
# shellcheck source=tools/device/env.sh
source "$(dirname "$0")/env.sh"
fs_device_env "${1:?bundle dir}" || exit 1
bundle=$FS_BUNDLE
mkdir -p "$out"

gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) tools/device/run_tp_scale.sh: $gpus GPU(s)" | tee "$out/scale.log"
nvidia-smi -L | tee -a "$out/scale.log"
if ((gpus < 4)); then
  echo "NEEDS 4 or 8 GPUs: $gpus visible; nothing to run" | tee -a "$out/scale.log"
  exit 2
fi

timeout 600 "$bundle/bin/tp_gpu_test" >"$out/tp_gpu_test.log" 2>&1
echo "tp_gpu_test rc=$?: $(grep -c '^\[       OK \]' "$out/tp_gpu_test.log") passed," \
  "$(grep -c '^\[  FAILED  \] .*(' "$out/tp_gpu_test.log") failed," \
  "$(grep -c '^\[  SKIPPED \] .*(' "$out/tp_gpu_test.log") skipped" | tee -a "$out/scale.log"

csv=$out/tp_scale.csv
: >"$csv"
for tp in 4 8; do
  ((tp <= gpus)) || continue
  devices=$(seq -s, 0 $((tp - 1)))
  for config in "llama 128256 8192" "qwen 151936 4096"; do
    # shellcheck disable=SC2086  # split "name V D" into $1 $2 $3
    set -- $config
    part=$out/tp${tp}_$1.csv
    timeout 300 "$bundle/bin/fs_tp_bench" --devices="$devices" --vocab="$2" \
      --hidden="$3" --batches=1,16,64,256 --csv="$part" >>"$out/scale.log" 2>&1
    echo "fs_tp_bench TP$tp $1 rc=$?" | tee -a "$out/scale.log"
    # One CSV: the header once, then every run's rows tagged with the config.
    [[ -s $csv ]] || head -1 "$part" | sed 's/^/config,/' >"$csv"
    tail -n +2 "$part" | sed "s/^/$1,/" >>"$csv"
    rm -f "$part"
  done
done

# Targets: TP4 >= 3.5x and TP8 >= 6.5x TP1 at B = 256 (both configs); TP8 <=
# 0.5x its all-gather baseline at B = 16; TP8 not slower than TP4 at B >= 64
# (small config). Columns: config,device,gpus,date,mode,tp,batch,...,us_min
# ($13), speedup_vs_tp1 ($15), ratio_vs_allgather ($16), mismatches ($17).
awk -F, 'NR > 1 && $5 ~ /_fused_nccl_device$/ {
    key = $1 " B=" $7
    us[$6, $1, $7] = $13
    if ($7 == 256) {
      need = ($6 == 4 ? 3.5 : 6.5)
      printf "TP%d %-6s B=256: %.2fx TP1 (need >= %.1f) %s\n", $6, $1, $15, need, ($15 >= need ? "ok" : "MISS")
    }
    if ($6 == 8 && $7 == 16) {
      printf "TP8 %-6s B=16: %.3f of all-gather (need <= 0.5) %s\n", $1, $16, ($16 <= 0.5 ? "ok" : "MISS")
    }
    if ($17 != 0) printf "TP%d %-6s B=%d: %d TOKENS DIFFER from TP1\n", $6, $1, $7, $17
  }
  END {
    for (b = 64; b <= 256; b *= 4) {
      if ((8, "qwen", b) in us && (4, "qwen", b) in us) {
        printf "qwen B=%d: TP8 %.1f us vs TP4 %.1f us %s\n", b, us[8, "qwen", b], us[4, "qwen", b], (us[8, "qwen", b] <= us[4, "qwen", b] ? "ok" : "MISS (TP8 slower)")
      }
    }
  }' "$csv" | tee -a "$out/scale.log"
