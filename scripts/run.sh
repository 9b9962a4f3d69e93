#!/usr/bin/env bash
# The main job: installs dependencies, builds, and runs loom-bench on every local GPU, writing
# bench/results/<date>-<sha>.json. On a machine without a GPU it says so and exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/cuda/bin:$PATH"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
scripts/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default
mkdir -p bench/results
out="bench/results/$(date -u +%Y%m%d-%H%M%S)-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown).json"
exec build/loom-bench all --spawn 0 --json "$out" "$@"
