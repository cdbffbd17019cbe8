#!/usr/bin/env bash
# Runs ON the GPU machine after tools/device/run.sh (or this script) has
# unpacked the bundle: profiles fs_bench's kernels at one (config, batch)
# with Nsight Compute, clocks left alone (--clock-control none: the GPU runs
# at the clocks it serves at, as in docs/performance.md),
# and writes text reports an engineer can read without the ncu GUI:
#   <out>/ncu_details.txt   per-launch sections (speed of light, compute and
#                           memory workload, warp states, scheduler stats)
#   <out>/ncu_raw.csv       every collected metric, one row per launch
#   <out>/ncu_source_*.txt  per-SASS-instruction stall samples of the fused
#                           kernel (where the ncu version can print them)
#   <out>/bench/            the fs_bench run that was profiled
#
#   tools/device/profile.sh <outdir> [config] [batch]   (default qwen 256)
#   FS_PROFILE_ARGS: more fs_bench flags (e.g. --multicast)
#
# With FS_PROFILE_METHODS (fs_controls_bench method names, comma-separated,
# e.g. "everything"), it profiles the controlled sampler's kernels of those
# methods instead (the token classes', chunk and merge kernels; every
# warp's stalls sampled): the same reports, and ncu_source_<kernel>.txt for
# each kernel's third launch (after a warm-up and the first timed call):
# UnitTokenClassesKernel, CandidateChunkKernel, and CandidateMergeKernel
# over the logits' chunks (...bool0) and over the fused kernel's units
# (...bool1).
set -uo pipefail
out=$1
config=${2:-qwen}
batch=${3:-256}
root=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=tools/device/env.sh
source "$root/tools/device/env.sh"
fs_device_env "${FS_BUNDLE_DIR:-$root/.device_bundle}" || exit 1
bundle=$FS_BUNDLE
mkdir -p "$out/bench"

ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu \
  /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [[ -z $ncu ]]; then
  echo "profile: ncu not found" >&2
  exit 1
fi
echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) tools/device/profile.sh $config B=$batch ($($ncu --version | tail -1))"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,power.limit --format=csv

if [[ -n ${FS_PROFILE_METHODS:-} ]]; then
  kernels=(UnitTokenClassesKernel CandidateChunkKernel CandidateMergeKernel)
  "$ncu" --clock-control none --cache-control all \
    -k "regex:$(IFS='|'; echo "${kernels[*]}")" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section Occupancy \
    --section LaunchStats --section SourceCounters --import-source no \
    --warp-sampling-interval 0 \
    -o "$out/profile" -f \
    "$bundle/bin/fs_controls_bench" --out "$out/bench" --configs "$config" \
    --batches "$batch" --iters 2 --warmup 1 --methods "$FS_PROFILE_METHODS" \
    >"$out/ncu_run.log" 2>&1
  echo "ncu rc=$? ($(grep -c '==PROF==' "$out/ncu_run.log") profiler lines)"
  tail -5 "$out/ncu_run.log"
  "$ncu" --import "$out/profile.ncu-rep" --page details >"$out/ncu_details.txt" 2>&1
  "$ncu" --import "$out/profile.ncu-rep" --page raw --csv >"$out/ncu_raw.csv" 2>&1
  # The merge kernel over the logits' chunks (<0>) and over the units (<1>).
  for kernel in UnitTokenClassesKernel CandidateChunkKernel \
    'CandidateMergeKernel<(bool)0>' 'CandidateMergeKernel<(bool)1>'; do
    name=${kernel//[^A-Za-z0-9]/}
    pattern=${kernel//[()]/.}
    "$ncu" --import "$out/profile.ncu-rep" --page source --print-source sass \
      --csv --kernel-name-base demangled -k "regex:$pattern" \
      --launch-skip 2 --launch-count 1 \
      >"$out/ncu_source_$name.txt" 2>&1 || true
  done
  ls -la "$out"
  exit 0
fi

# Kernels: the fused kernel (wgmma and mma.sync) and cuBLAS's GEMM. Two
# timed calls of each fs_bench method after one warm-up; the three launches
# of "fused", "fused_two_launches" and "fused_all_greedy" come in that
# order (fs_bench --no-sweep), so the report's launch order names them.
# shellcheck disable=SC2086  # FS_PROFILE_ARGS is a list of flags
"$ncu" --clock-control none --cache-control all \
  -k 'regex:Fused|gemm|nvjet|Gemm' \
  --section SpeedOfLight --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section WarpStateStats \
  --section SchedulerStats --section InstructionStats --section LaunchStats \
  --section SourceCounters --import-source no \
  -o "$out/profile" -f \
  "$bundle/bin/fs_bench" --out "$out/bench" --configs "$config" \
  --batches "$batch" --iters 2 --warmup 1 --no-sweep ${FS_PROFILE_ARGS:-} \
  >"$out/ncu_run.log" 2>&1
echo "ncu rc=$? ($(grep -c '==PROF==' "$out/ncu_run.log") profiler lines)"
tail -5 "$out/ncu_run.log"
"$ncu" --import "$out/profile.ncu-rep" --page details >"$out/ncu_details.txt" 2>&1
"$ncu" --import "$out/profile.ncu-rep" --page raw --csv >"$out/ncu_raw.csv" 2>&1
# Per-instruction stall samples of the first fused launch ("fused") and of
# the first all-greedy one (the 3rd fused kernel method: launches 6..8).
for launch in 0 6; do
  "$ncu" --import "$out/profile.ncu-rep" --page source --print-source sass \
    --csv -k regex:Fused --launch-skip "$launch" --launch-count 1 \
    >"$out/ncu_source_$launch.txt" 2>&1 || true
done
ls -la "$out"
