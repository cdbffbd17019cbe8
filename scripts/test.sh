#!/usr/bin/env bash
# The README's test command. On a fresh Debian 12 machine it installs what it
# needs, configures once, builds everything with -j2, checks formatting and
# runs every test (GPU tests skip, loudly, without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${FS_BUILD_DIR:-build}
scripts/install_deps.sh
cmake -S . -B "$build_dir" -DFS_WERROR=ON
cmake --build "$build_dir" -j2
scripts/check_format.sh
ctest --test-dir "$build_dir" --output-on-failure -j2
