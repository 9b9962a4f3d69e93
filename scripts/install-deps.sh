#!/usr/bin/env bash
# Installs what building and testing loom needs on a Debian/Ubuntu machine (idempotent).
# The CUDA toolkit (nvcc >= 12.4 with CCCL) must already be present: it is not a Debian package
# recent enough for sm_90a.
set -euo pipefail

packages=(cmake ninja-build g++ pkg-config libgtest-dev libgmock-dev libcli11-dev nlohmann-json3-dev libssl-dev
          libibverbs-dev libfabric-dev python3-dev python3-venv)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [[ $(id -u) -ne 0 ]] && sudo="sudo"
  echo "install-deps: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v nvcc >/dev/null 2>&1; then
  if [[ -x /usr/local/cuda/bin/nvcc ]]; then
    echo "install-deps: nvcc is at /usr/local/cuda/bin; add it to PATH (export PATH=/usr/local/cuda/bin:\$PATH)"
  else
    echo "install-deps: the CUDA toolkit (nvcc >= 12.4) is missing; install it from NVIDIA first" >&2
  fi
  exit 1
fi
