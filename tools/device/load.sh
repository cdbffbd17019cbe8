#!/usr/bin/env bash
# Runs ON the GPU machine, from the repository root with .device_bundle/
# (made by tools/device/bundle.sh) beside it: starts flashsamplerd on the
# CUDA backend with synthetic V=151936, D=4096 bf16 weights, drives it with
# fs_load in closed loop over loopback for each load shape of
# docs/performance.md#service (8 s measured after 2 s of warm-up), writes
# one summary line per shape to <outdir>/service.csv, then stops the daemon
# with SIGTERM and checks that it exits 0.
#
#   tools/device/load.sh <outdir>
#   FS_LOAD_SHAPES: "callers:rows ..." (default "1:1 16:1 64:1 256:1 1:256 4:64")
set -uo pipefail
if (($# < 1)); then
  echo "usage: $0 <outdir>" >&2
  exit 2
fi
out=$1
root=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=tools/device/env.sh
source "$root/tools/device/env.sh"
fs_device_env "${FS_BUNDLE_DIR:-$root/.device_bundle}" || exit 1
bundle=$FS_BUNDLE
for binary in flashsamplerd fs_load; do
  if [[ ! -x $bundle/bin/$binary ]]; then
    echo "load: $binary is not in the bundle (tools/device/bundle.sh builds it where gRPC is found)" >&2
    exit 1
  fi
done
mkdir -p "$out"
log=$out/daemon.log
"$bundle/bin/flashsamplerd" --backend=cuda \
  --weights=synthetic:vocab=151936,hidden=4096,seed=1,dtype=bf16 \
  --listen_address=127.0.0.1:0 --metrics_port=0 >"$log" 2>&1 &
pid=$!

# The port is chosen by the daemon and logged once the weights are loaded.
port=""
for _ in $(seq 1 1200); do
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "load: flashsamplerd exited during startup:" >&2
    tail -20 "$log" >&2
    exit 1
  fi
  port=$(sed -n 's/.*serving on port \([0-9]*\).*/\1/p' "$log" | head -n 1)
  [[ -n $port ]] && break
  sleep 0.2
done
if [[ -z $port ]]; then
  echo "load: flashsamplerd did not start within 240 s" >&2
  kill -TERM "$pid"
  exit 1
fi

status=0
rm -f "$out/service.csv"
for shape in ${FS_LOAD_SHAPES:-1:1 16:1 64:1 256:1 1:256 4:64}; do
  callers=${shape%%:*}
  rows=${shape##*:}
  echo "== fs_load closed loop: $callers callers x $rows rows" | tee -a "$out/load.log"
  "$bundle/bin/fs_load" --target="127.0.0.1:$port" --mode=closed \
    --concurrency="$callers" --rows="$rows" --dtype=bf16 --temperature=1 \
    --warmup=2s --duration=8s --summary_csv="$out/service.csv" \
    --label="callers=$callers rows=$rows" 2>&1 | tee -a "$out/load.log"
  ((PIPESTATUS[0] == 0)) || status=1
done

kill -TERM "$pid"
wait "$pid"
daemon_rc=$?
echo "daemon exit=$daemon_rc" | tee -a "$out/load.log"
((daemon_rc == 0)) || status=1
exit $status
