#!/usr/bin/env bash
# Runs HERE (no GPU needed): builds the GPU tests, fs_bench and, when they
# build, flashsamplerd, fs_load, fs_engine_bench and the tensor-parallel
# test and benchmark for sm_90a in a separate build directory
# (build-device/), and copies
# them with every non-system shared library they need into .device_bundle/
# (ignored by git) as one xz archive (OpenBLAS alone is 36 MB unpacked; the
# archive is ~17 MB). Take that folder to the GPU machine and run
# tools/device/run.sh there, which unpacks it. cuBLAS (600 MB) and NCCL
# are not bundled: the GPU machine's own copies are used (tools/device/run.sh
# finds them).
#
#   tools/device/bundle.sh            # FS_BUNDLE_DAEMON=0 skips the daemon and fs_load
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
build=${FS_DEVICE_BUILD_DIR:-$root/build-device}
bundle=$root/.device_bundle
max_mib=60

# Makefiles, whatever CMAKE_GENERATOR says: the optional targets are found
# in their `help` listing below (Ninja's lists no executables).
if [[ -f $build/CMakeCache.txt ]] &&
  ! grep -qx 'CMAKE_GENERATOR:INTERNAL=Unix Makefiles' "$build/CMakeCache.txt"; then
  echo "bundle: $build was configured with another generator;" \
    "remove it or set FS_DEVICE_BUILD_DIR" >&2
  exit 1
fi
cmake -G "Unix Makefiles" -S "$root" -B "$build" -DFS_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a \
  -DCMAKE_BUILD_TYPE=Release -DFS_WERROR=ON >/dev/null
required=(fused_sampler_gpu_test cuda_engine_gpu_test controlled_sampler_gpu_test
          controls_stats_gpu_test cuda_fault_gpu_test fs_bench fs_controls_bench)
cmake --build "$build" --target "${required[@]}" -j2
binaries=(
  "$build/bin/fused_sampler_gpu_test"
  "$build/bin/cuda_engine_gpu_test"
  "$build/bin/controlled_sampler_gpu_test"
  "$build/bin/controls_stats_gpu_test"
  "$build/bin/cuda_fault_gpu_test"
  "$build/bin/fs_bench"
  "$build/bin/fs_controls_bench"
)
# Optional extras: skipped (with a note) where the configure step left them
# out (no gRPC for the daemon, no NCCL for the tensor-parallel ones); a
# defined target that fails to compile fails the bundle, so that a broken
# test cannot silently drop out of the device run.
optional=()
if [[ ${FS_BUNDLE_DAEMON:-1} == 1 ]]; then
  optional+=(flashsamplerd fs_load flashsamplerd_null_engine fs_engine_bench)
fi
optional+=(fs_tp_bench tp_gpu_test)
# The Makefiles' target list ("... name" lines). A failing help call fails
# the script (set -e) rather than making every optional target look absent.
defined_targets=$(cmake --build "$build" --target help)
for target in "${optional[@]}"; do
  if ! grep -qE "^\.\.\. $target( |$)" <<<"$defined_targets"; then
    echo "bundle: no $target target in this configuration; bundling without it" >&2
    continue
  fi
  if ! cmake --build "$build" --target "$target" -j2 >"$build/$target.log" 2>&1; then
    echo "bundle: $target did not build:" >&2
    grep -E "error|Error" "$build/$target.log" | head -20 >&2 || true
    echo "bundle: full log in $build/$target.log" >&2
    exit 1
  fi
  binaries+=("$build/bin/$target")
done

staging=$build/bundle_staging
rm -rf "$bundle" "$staging"
mkdir -p "$bundle" "$staging/bin" "$staging/lib"
for binary in "${binaries[@]}"; do
  cp "$binary" "$staging/bin/"
  strip --strip-debug "$staging/bin/$(basename "$binary")"
done
cp "$root/kernels/baselines/plot_bench.py" "$staging/"

# Non-system shared libraries: everything ldd resolves except the C/C++
# runtime, the CUDA driver, and cuBLAS/NCCL (taken from the GPU machine).
skip='^(libc|libm|libstdc\+\+|libgcc_s|ld-linux.*|libpthread|libdl|librt|libcuda|libcublas|libcublasLt|libnccl|linux-vdso)\.so'
for binary in "${binaries[@]}"; do
  ldd "$binary" | awk '/=> \// {print $1, $3}' | while read -r name path; do
    if [[ $name =~ $skip ]]; then continue; fi
    [[ -e "$staging/lib/$name" ]] || cp -L "$path" "$staging/lib/$name"
  done
done
# xz -9's 64 MiB window spans several binaries, which share their kernels:
# the bundle packs to 17 MB, where the default preset's 8 MiB left 56.
tar -C "$staging" -cf - bin lib plot_bench.py | xz -9 -T1 >"$bundle/bundle.tar.xz"
size_mib=$(du -sm "$bundle" | cut -f1)
echo "bundle: $bundle/bundle.tar.xz holds $(ls "$staging/bin" | wc -l) binaries and $(ls "$staging/lib" | wc -l) libraries, ${size_mib} MiB"
ls "$staging/bin"
if ((size_mib > max_mib)); then
  echo "bundle: ${size_mib} MiB is over the ${max_mib} MiB limit" >&2
  exit 1
fi
