#!/usr/bin/env bash
# The README's run command. On a fresh Debian 12 machine: installs what it
# needs, builds flashsamplerd and flashsampler-cli, starts the daemon on
# synthetic weights (asked for by name: the daemon serves nothing without
# --weights) on free loopback ports, waits until health says SERVING, samples tokens for random hidden states with the CLI, shows where
# the metrics are (and a few of them), then stops the daemon with SIGTERM
# and checks that it drained and exited 0.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${FS_BUILD_DIR:-build}

scripts/install_deps.sh
cmake -S . -B "$build_dir" -DFS_WERROR=ON
cmake --build "$build_dir" --target flashsamplerd flashsampler-cli -j2

daemon="$build_dir/bin/flashsamplerd"
cli="$build_dir/bin/flashsampler-cli"
work=$(mktemp -d -t flashsampler-demo.XXXXXX)
log="$work/flashsamplerd.log"
daemon_pid=""
cleanup() {
  if [[ -n "$daemon_pid" ]] && kill -0 "$daemon_pid" 2>/dev/null; then
    kill -KILL "$daemon_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# Metrics need a port chosen up front; the gRPC port is picked by the daemon
# (port 0) and read from its log.
metrics_port=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
echo "== starting flashsamplerd (synthetic weights: V=32000, D=512)"
"$daemon" --weights=synthetic:vocab=32000,hidden=512,seed=1 \
  --listen_address=127.0.0.1:0 --metrics_address=127.0.0.1 \
  --metrics_port="$metrics_port" --drain_timeout=10s 2>"$log" &
daemon_pid=$!

port=""
for _ in $(seq 1 600); do
  if ! kill -0 "$daemon_pid" 2>/dev/null; then
    echo "flashsamplerd exited during startup:" >&2
    cat "$log" >&2
    exit 1
  fi
  port=$(sed -n 's/.*serving on port \([0-9]*\).*/\1/p' "$log" | head -n 1)
  [[ -n "$port" ]] && break
  sleep 0.2
done
if [[ -z "$port" ]]; then
  echo "flashsamplerd did not start within 120 s:" >&2
  cat "$log" >&2
  exit 1
fi
target="127.0.0.1:$port"

echo "== waiting for grpc.health.v1 SERVING on $target"
for _ in $(seq 1 100); do
  if health=$("$cli" health --target="$target" --timeout=2s --retries=1 2>/dev/null); then
    break
  fi
  sleep 0.2
done
echo "health: ${health:-not serving}"
[[ "${health:-}" == "SERVING" ]]

echo "== flashsampler-cli info"
"$cli" info --target="$target" | grep -E "^(vocab_size|hidden_size|weight_dtype|backend|tp_degree|max_batch_rows)"

echo "== flashsampler-cli sample --rows=4 --n=2 --random (server-drawn seeds)"
"$cli" sample --target="$target" --rows=4 --n=2 --random \
  --random_seed="$RANDOM"

echo "== metrics: http://127.0.0.1:$metrics_port/metrics"
/usr/bin/python3 - "$metrics_port" <<'EOF'
import sys
import urllib.request

url = f"http://127.0.0.1:{sys.argv[1]}/metrics"
text = urllib.request.urlopen(url, timeout=10).read().decode()
wanted = ("flashsampler_requests_total", "flashsampler_rows_sampled_total",
          "flashsampler_request_duration_seconds_count",
          "flashsampler_batch_rows_count", "flashsampler_weights_info")
for line in text.splitlines():
    if line.startswith(wanted):
        print("  " + line)
EOF

echo "== stopping flashsamplerd (SIGTERM: NOT_SERVING, drain, exit)"
kill -TERM "$daemon_pid"
for _ in $(seq 1 300); do  # the drain takes at most --drain_timeout=10s
  kill -0 "$daemon_pid" 2>/dev/null || break
  sleep 0.1
done
if kill -0 "$daemon_pid" 2>/dev/null; then
  echo "flashsamplerd still running 30 s after SIGTERM:" >&2
  cat "$log" >&2
  exit 1
fi
status=0
wait "$daemon_pid" || status=$?
daemon_pid=""
sed 's/^/  /' "$log" | tail -n 3
if ((status != 0)); then
  echo "flashsamplerd exited with status $status" >&2
  exit 1
fi
echo "== done: flashsamplerd exited 0"
