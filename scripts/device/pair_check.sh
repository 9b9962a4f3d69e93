#!/usr/bin/env bash
# On the GPU machine: how much of a torch-vs-loom ratio is the GPU's state rather than the code.
# Runs bench/torch_fused.py three times: torch alone, torch with loom beside it (--loom:
# shuffled rounds in one process, same inputs), torch alone again. Needs .device-carry
# (scripts/device/stage.sh); prints the rows (bench/results/*_torch_alone_vs_paired_*.txt).
#   OUT=/tmp/out scripts/device/pair_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export WORK=${WORK:-/tmp/loom-work} OUT=${OUT:-/tmp/loom-out}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT"
scripts/device/build_python_ext.sh "$OUT/ext.log" || { echo "extension build failed: $OUT/ext.log"; exit 1; }
run() {
  PYTHONPATH="$WORK/pkg" timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
    bench/torch_fused.py --ops ag_gemm,gemm_rs --m-values 1024,2048,4096,8192 --iters 30 "$@" 2>&1 |
    grep -E "^torch_fused|rror"
}
echo "== torch alone"; run
echo "== paired"; run --loom
echo "== torch alone again"; run
