#!/usr/bin/env bash
# The test command: installs dependencies, builds everything, runs the CPU suite, and the GPU
# suite too when this machine has an NVIDIA GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/cuda/bin:$PATH"
scripts/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default
ctest --preset cpu
if nvidia-smi -L >/dev/null 2>&1; then
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 ctest --preset gpu
else
  echo "test.sh: no NVIDIA GPU here; the GPU suite (ctest --preset gpu) was not run"
fi
