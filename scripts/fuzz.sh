#!/usr/bin/env bash
# Coverage-guided fuzzing of the tests/fuzz targets with libFuzzer, ASan and
# UBSan: configures build-fuzz with clang and FS_FUZZ=ON, builds the targets
# and runs each for N seconds (default 60) on one core.
#   scripts/fuzz.sh [SECONDS] [TARGET...]   e.g. scripts/fuzz.sh 3600 safetensors
# New inputs accumulate in build-fuzz/tests/fuzz/work/<target>/ (the seeds in
# tests/fuzz/corpus/<target>/ are read, never written); a crash leaves
# build-fuzz/fuzz-artifacts/<target>/crash-* to rerun with
#   build-fuzz/bin/<target>_fuzz FILE
# Needs clang and libclang-rt-14-dev (apt-get install clang libclang-rt-14-dev).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(request_codec safetensors stream_framing metrics_http)
fi
build_dir=${FS_FUZZ_BUILD_DIR:-build-fuzz}
CC=${CC:-clang} CXX=${CXX:-clang++} cmake -S . -B "$build_dir" \
  -DFS_FUZZ=ON -DFS_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build "$build_dir" -j"${FS_JOBS:-2}" \
  --target "${targets[@]/%/_fuzz}"
status=0
for target in "${targets[@]}"; do
  work="$build_dir/tests/fuzz/work/$target"
  artifacts="$build_dir/fuzz-artifacts/$target"
  mkdir -p "$work" "$artifacts"
  echo "== $target: ${seconds}s"
  if ! "$build_dir/bin/${target}_fuzz" -max_total_time="$seconds" \
      -print_final_stats=1 -artifact_prefix="$artifacts/" \
      "$work" "tests/fuzz/corpus/$target"; then
    echo "== $target: FAILED (reproducers in $artifacts)"
    status=1
  fi
done
exit $status
