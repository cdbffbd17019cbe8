#!/usr/bin/env bash
# Runs ON the GPU machine after tools/device/run.sh unpacked the bundle: starts
# flashsamplerd on the CUDA backend (all visible GPUs, synthetic Qwen3-8B-sized
# weights), samples through the Python client with fixed seeds twice (the
# tokens must repeat), checks ModelInfo, then stops the daemon with SIGTERM
# and checks it exits 0. Needs the generated Python modules in
# build-device/python (carry it) and grpcio/numpy from the image's python3.
#
#   tools/device/e2e.sh <outdir> [bundle_dir]
set -uo pipefail
out=$1
root=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=tools/device/env.sh
source "$root/tools/device/env.sh"
fs_device_env "${2:-${TMPDIR:-/tmp}/fs_device_bundle}" || exit 1
bundle=$FS_BUNDLE
mkdir -p "$out"
"$bundle/bin/flashsamplerd" --backend=cuda \
  --weights=synthetic:vocab=151936,hidden=4096,seed=1 \
  --listen_address=127.0.0.1:50051 --metrics_port=0 >"$out/daemon.log" 2>&1 &
pid=$!
PYTHONPATH=$root/build-device/python:$root/client/python python3 - <<'PY' 2>&1 | tee "$out/e2e.log"
import time
import numpy as np
from flashsampler_client import FlashSamplerClient, UnavailableError

client = FlashSamplerClient("127.0.0.1:50051", timeout=30.0, retries=8)


def serving():
    # The port opens only once the weights are loaded and warmed up (at
    # TP = 8 that outlasts the client's own retries): refused = not yet.
    try:
        return client.health() == "SERVING"
    except UnavailableError:
        return False


deadline = time.time() + 240
while not serving():
    if time.time() > deadline:
        raise SystemExit("daemon never became SERVING")
    time.sleep(1)
info = client.model_info()
print("backend", info.backend, "tp", info.tp_degree, "V", info.vocab_size,
      "D", info.hidden_size, "shards",
      [(s.vocab_begin, s.vocab_end) for s in info.shards])
assert info.backend == "cuda"
rng = np.random.default_rng(7)
# 100 rows: one 128-wide batch tile, the path whose CTA pairs share H
# (TMA multicast) on this vocabulary.
hidden = rng.standard_normal((100, info.hidden_size)).astype(np.float32)
seeds = list(range(1000, 1100))
first, _ = client.sample(hidden, seeds=seeds, temperature=1.0)
again, _ = client.sample(hidden, seeds=seeds, temperature=1.0)
assert (first == again).all(), "same seeds gave different tokens"
for row in (5, 90):  # one row from each CTA's half of H
    alone, _ = client.sample(hidden[row:row + 1], seeds=seeds[row:row + 1],
                             temperature=1.0)
    assert alone[0, 0] == first[row, 0], f"row {row} alone differs from row {row} in a batch"
print("tokens[:8]", first[:8, 0].tolist())
print("E2E OK")
PY
rc=${PIPESTATUS[0]}
kill -TERM "$pid"
wait "$pid"
daemon_rc=$?
echo "python rc=$rc daemon exit=$daemon_rc" | tee -a "$out/e2e.log"
tail -5 "$out/daemon.log"
[[ $rc == 0 && $daemon_rc == 0 ]]
