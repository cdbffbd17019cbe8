#!/usr/bin/env bash
# Runs ON the GPU machine: times several fs_bench binaries (builds of
# different trees) against each other on one machine, alternating them run
# by run so that the GPU's clock and power drift hits each alike, and prints
# the fused / cuBLAS ratio and the fused time per binary, config and batch
# (median over the rounds). Machines of one kind differ by several percent
# (docs/performance.md), so a change is judged from one such run, not from
# runs on two machines.
#
#   tools/device/ab.sh <outdir> <rounds> <fs_bench> [<fs_bench> ...]
#   (each fs_bench a binary built here, e.g. copied out of build-device/ of
#   two trees into an ignored folder that the device call carries)
#   FS_AB_ARGS: fs_bench flags (default: --configs qwen,llama
#               --batches 64,128,256 --no-sweep)
set -uo pipefail
if (($# < 3)); then
  echo "usage: $0 <outdir> <rounds> <fs_bench> [<fs_bench> ...]" >&2
  exit 2
fi
out=$1
rounds=$2
shift 2
root=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=tools/device/env.sh
source "$root/tools/device/env.sh"
fs_device_env "${FS_BUNDLE_DIR:-$root/.device_bundle}" || exit 1
args=${FS_AB_ARGS:---configs qwen,llama --batches 64,128,256 --no-sweep}
mkdir -p "$out"
# Each run's own files stay on the machine; <outdir> gets ab.log and ab.csv.
runs=$(mktemp -d)
echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) tools/device/ab.sh $rounds rounds: $*" | tee "$out/ab.log"
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader | tee -a "$out/ab.log"
for ((r = 0; r < rounds; ++r)); do
  for ((i = 1; i <= $#; ++i)); do
    binary=${!i}
    dir=$runs/r${r}_b$i
    mkdir -p "$dir"
    # shellcheck disable=SC2086  # args is a list of flags
    if ! "$binary" --out "$dir" $args >"$dir/stdout.txt" 2>&1; then
      echo "round $r binary $i ($binary) failed; see $dir/stdout.txt" | tee -a "$out/ab.log"
    fi
  done
done
python3 - "$runs" "$out/ab.csv" "$rounds" "$@" <<'PY' | tee -a "$out/ab.log"
import csv, statistics, sys
runs, table, rounds, binaries = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
rows = {}
all_rows = []
for r in range(rounds):
    for i in range(1, len(binaries) + 1):
        try:
            with open(f"{runs}/r{r}_b{i}/results.csv") as f:
                for row in csv.DictReader(f):
                    all_rows.append({"round": r, "binary": i, **row})
                    key = (row["config"], int(row["batch"]))
                    rows.setdefault(key, {}).setdefault(i, []).append(
                        (float(row["fused_us"]), float(row["fused_over_cublas"])))
        except OSError:
            pass
print("config  B     " + "  ".join(f"b{i}: fused_us ratio" for i in range(1, len(binaries) + 1)))
for key in sorted(rows):
    cells = []
    for i in range(1, len(binaries) + 1):
        runs = rows[key].get(i, [])
        if runs:
            cells.append(f"{statistics.median(u for u, _ in runs):8.1f} {statistics.median(q for _, q in runs):.3f}")
        else:
            cells.append("       -     -")
    print(f"{key[0]:6s} {key[1]:4d}  " + "    ".join(cells))
for i, b in enumerate(binaries, 1):
    print(f"b{i} = {b}")
if all_rows:
    with open(table, "w", newline="") as f:
        # Builds of different trees may write different columns: the union,
        # empty where a build has none.
        fields = list(dict.fromkeys(k for row in all_rows for k in row))
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(all_rows)
PY
