#!/usr/bin/env bash
# Runs HERE (no GPU needed): builds the GPU tests, fs_bench and, when it
# builds, flashsamplerd for sm_90a in a separate build directory, and copies
# them with every non-system shared library they need into .device_bundle/
# (ignored by git) as one xz archive (OpenBLAS alone is 36 MB unpacked; the
# archive is ~13 MB). Take that folder to the GPU machine and run
# scripts/device_run.sh there, which unpacks it. cuBLAS (600 MB) and NCCL
# are not bundled: the GPU machine's own copies are used (device_run.sh
# finds them).
#
#   scripts/device_bundle.sh            # FS_BUNDLE_DAEMON=0 skips the daemon
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
build=${FS_DEVICE_BUILD_DIR:-$root/build-device}
bundle=$root/.device_bundle
max_mib=60

cmake -S "$root" -B "$build" -DFS_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
  -DCMAKE_BUILD_TYPE=Release -DFS_WERROR=ON >/dev/null
targets=(fused_sampler_gpu_test cuda_engine_gpu_test fs_bench)
cmake --build "$build" --target "${targets[@]}" -j2
binaries=(
  "$build/tests/gpu/fused_sampler_gpu_test"
  "$build/tests/gpu/cuda_engine_gpu_test"
  "$build/kernels/bench/fs_bench"
)
# Optional extras: bundled when they build, skipped (with a note) otherwise.
optional=()
if [[ ${FS_BUNDLE_DAEMON:-1} == 1 ]]; then
  optional+=(flashsamplerd)
fi
optional+=(fs_tp_bench tp_gpu_test)
for target in "${optional[@]}"; do
  if cmake --build "$build" --target "$target" -j2 >"$build/$target.log" 2>&1; then
    binaries+=("$(find "$build" -type f -name "$target" -perm -u+x | head -1)")
  else
    echo "device_bundle: $target did not build (see $build/$target.log); bundling without it" >&2
  fi
done

staging=$build/bundle_staging
rm -rf "$bundle" "$staging"
mkdir -p "$bundle" "$staging/bin" "$staging/lib"
for binary in "${binaries[@]}"; do
  cp "$binary" "$staging/bin/"
  strip --strip-debug "$staging/bin/$(basename "$binary")"
done
cp "$root/kernels/bench/plot_bench.py" "$staging/"

# Non-system shared libraries: everything ldd resolves except the C/C++
# runtime, the CUDA driver, and cuBLAS/NCCL (taken from the GPU machine).
skip='^(libc|libm|libstdc\+\+|libgcc_s|ld-linux.*|libpthread|libdl|librt|libcuda|libcublas|libcublasLt|libnccl|linux-vdso)\.so'
for binary in "${binaries[@]}"; do
  ldd "$binary" | awk '/=> \// {print $1, $3}' | while read -r name path; do
    if [[ $name =~ $skip ]]; then continue; fi
    [[ -e "$staging/lib/$name" ]] || cp -L "$path" "$staging/lib/$name"
  done
done
tar -C "$staging" -cJf "$bundle/bundle.tar.xz" bin lib plot_bench.py
size_mib=$(du -sm "$bundle" | cut -f1)
echo "device_bundle: $bundle/bundle.tar.xz holds $(ls "$staging/bin" | wc -l) binaries and $(ls "$staging/lib" | wc -l) libraries, ${size_mib} MiB"
ls "$staging/bin"
if ((size_mib > max_mib)); then
  echo "device_bundle: ${size_mib} MiB is over the ${max_mib} MiB limit" >&2
  exit 1
fi
