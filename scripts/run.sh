#!/usr/bin/env bash
# The main job: on a machine with NVIDIA GPUs, installs dependencies, builds, and runs loom-bench on
# every local GPU, writing bench/results/<date>-<sha>.json (loom-bench records the versions, the
# GPU and the environment in it). Without a GPU it says so first and exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."

# Checked before anything is installed or built: without a GPU none of it could be used.
if ! command -v nvidia-smi >/dev/null 2>&1 || ! gpus=$(nvidia-smi -L 2>/dev/null) || [[ -z "$gpus" ]]; then
  echo "run.sh: no NVIDIA GPU found (nvidia-smi -L lists none). loom's kernels need Hopper GPUs (sm_90a);" \
       "the CPU tests run anywhere: scripts/test.sh" >&2
  exit 1
fi
echo "run.sh: $(grep -c '^GPU ' <<<"$gpus") GPU(s):"
echo "$gpus"

export PATH="/usr/local/cuda/bin:$PATH"
# NVLink multicast (NVLS) off unless the caller sets NCCL_NVLS_ENABLE: on GPUs shared with other
# users, a program that uses multicast can put them out of service for everyone. On a machine of
# your own, run NCCL_NVLS_ENABLE=1 scripts/run.sh, or loom-bench itself (NCCL's defaults).
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
scripts/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default
mkdir -p bench/results
out="bench/results/$(date -u +%Y%m%d-%H%M%S)-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown).json"
exec build/loom-bench all --spawn 0 --json "$out" "$@"
