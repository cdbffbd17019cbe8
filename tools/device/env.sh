#!/usr/bin/env bash
# Sourced (not run) by the scripts that run ON the GPU machine. Provides
# fs_device_env DIR: DIR is either the folder holding bundle.tar.xz (made by
# tools/device/bundle.sh; unpacked into $TMPDIR/fs_device_bundle) or an
# unpacked bundle. Sets FS_BUNDLE to the unpacked bundle's absolute path,
# turns NVLink multicast off for every child process
# (docs/design.md#nvlink-multicast), and puts
# the bundle's libraries, the image's cuBLAS and its NCCL 2.28.9 (matching
# the headers the bundle was built with; the system NCCL is older) on the
# library path.
fs_device_env() {
  local dir=$1
  if [[ -f $dir/bundle.tar.xz ]]; then
    local unpacked=${TMPDIR:-/tmp}/fs_device_bundle
    rm -rf "$unpacked"
    mkdir -p "$unpacked"
    tar -C "$unpacked" -xJf "$dir/bundle.tar.xz" || return 1
    dir=$unpacked
  fi
  FS_BUNDLE=$(cd "$dir" && pwd) || return 1
  export FS_BUNDLE
  export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
  local nvidia=/opt/torch/.venv/lib/python3.12/site-packages/nvidia
  local cublas
  cublas=$(find "$nvidia" /usr/local/cuda/lib64 /usr/local/cuda/targets \
    -name 'libcublas.so.13*' 2>/dev/null | head -1)
  local cublas_dir=$nvidia/cublas/lib
  [[ -n $cublas ]] && cublas_dir=$(dirname "$cublas")
  export LD_LIBRARY_PATH=$FS_BUNDLE/lib:$cublas_dir:$nvidia/cuda_runtime/lib:$nvidia/nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}
