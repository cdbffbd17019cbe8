#!/usr/bin/env bash
# Runs ON the GPU machine, from the repository root with .device_bundle/
# (made by tools/device/bundle.sh) beside it: times the fused kernel alone
# with fs_bench (qwen config, the batch sizes the service grid produces),
# then runs load/service_bench.py on flashsamplerd --backend=cuda with
# synthetic V=151936, D=4096 bf16 weights over the full grid, and prints the
# service table with the kernel's time beside each point.
#
#   tools/device/service_bench.sh <outdir> [service_bench.py args...]
#   e.g. tools/device/service_bench.sh /tmp/sb --grid smoke
set -uo pipefail
if (($# < 1)); then
  echo "usage: $0 <outdir> [service_bench.py args...]" >&2
  exit 2
fi
out=$1
shift
root=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=tools/device/env.sh
source "$root/tools/device/env.sh"
fs_device_env "${FS_BUNDLE_DIR:-$root/.device_bundle}" || exit 1
bundle=$FS_BUNDLE
for binary in flashsamplerd fs_load fs_bench; do
  if [[ ! -x $bundle/bin/$binary ]]; then
    echo "service_bench: $binary is not in the bundle (tools/device/bundle.sh)" >&2
    exit 1
  fi
done
mkdir -p "$out/kernel"
echo "== fs_bench (kernel alone)"
timeout "${FS_BENCH_TIMEOUT:-300}" "$bundle/bin/fs_bench" --out "$out/kernel" \
  --configs qwen --batches 1,2,4,8,16,32,64,128,256 --no-sweep \
  >"$out/kernel/fs_bench.log" 2>&1
kernel_rc=$?
if ((kernel_rc != 0)); then
  echo "service_bench: fs_bench exited $kernel_rc (the kernel column stays empty)" >&2
fi
echo "== service_bench (flashsamplerd --backend=cuda)"
python3 "$root/load/service_bench.py" --daemon "$bundle/bin/flashsamplerd" \
  --load "$bundle/bin/fs_load" --backend cuda \
  --weights synthetic:vocab=151936,hidden=4096,seed=1,dtype=bf16 \
  --kernel_csv "$out/kernel/results.csv" --out "$out" "$@"
status=$?
null_args=()
for arg in "$@"; do
  [[ $arg == --unix_socket ]] && null_args+=("$arg")
done
if [[ -x $bundle/bin/flashsamplerd_null_engine ]]; then
  # The same serving path on an engine that answers at once: the ceiling of
  # the service and of fs_load on this machine, without the GPU.
  echo "== service_bench (the null engine: the service alone)"
  python3 "$root/load/service_bench.py" \
    --daemon "$bundle/bin/flashsamplerd_null_engine" \
    --load "$bundle/bin/fs_load" --backend null --grid callers \
    --duration 4s --warmup 1s --out "$out/null" "${null_args[@]}" || status=1
fi
exit $status
