#!/usr/bin/env bash
# Installs the Debian 12 packages flashsampler builds, tests and runs with
# (shared by scripts/run_demo.sh, scripts/test.sh and deploy/Dockerfile).
# Skips apt entirely when every package is installed already, so repeated
# runs take a fraction of a second. Uses sudo when not root.
set -euo pipefail

packages=(
  # toolchain
  cmake g++ pkg-config clang-format
  # gRPC, protobuf (C++ and the Python plugin), Abseil, metrics, JSON
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev nlohmann-json3-dev libssl-dev
  # CPU backend BLAS
  libopenblas-dev
  # tests and benchmarks
  libgtest-dev libgmock-dev libbenchmark-dev
  # Prometheus server and promtool (scrape test, alert-rule checks)
  prometheus
  # Python client, its tests and packaging, the latency plots, the
  # statistical tests and the manifest checks
  python3-grpcio python3-protobuf python3-numpy python3-scipy
  python3-matplotlib python3-yaml python3-pip python3-setuptools
  python3-wheel python3-venv
)

missing=()
for package in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$package" 2>/dev/null || true)
  if [[ "$status" != "install ok installed" ]]; then
    missing+=("$package")
  fi
done
if ((${#missing[@]} == 0)); then
  echo "install_deps: all ${#packages[@]} packages present"
else
  echo "install_deps: installing ${missing[*]}"
  sudo=()
  if ((EUID != 0)); then
    sudo=(sudo)
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update
  "${sudo[@]}" apt-get install -y --no-install-recommends "${packages[@]}"
fi

# The Kubernetes JSON schemas the deployment tests validate every rendered
# object against. Not in Debian: installed for this user only (never into
# the system's Python), pinned to the Kubernetes version the tests name.
kubernetes_validate=kubernetes-validate==1.32.0
if ! /usr/bin/python3 -c 'import kubernetes_validate' 2>/dev/null; then
  echo "install_deps: pip install --user $kubernetes_validate"
  /usr/bin/python3 -m pip install --quiet --user --break-system-packages \
    --no-warn-script-location \
    "$kubernetes_validate"
fi
