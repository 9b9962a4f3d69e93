# Sourced by the scripts in scripts/device/ (on the GPU machine): NVLink multicast stays off (it
# can take a shared host's GPUs out of service), bounded waits shorter than the defaults, Python
# output unbuffered, $OUT (comes back) / $WORK (stays there) exist, and an earlier build staged
# compressed in .device-carry/base or variants/ (stage.sh --base / --variant: the carry holds
# 64 MiB) is unpacked.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LOOM_BOOTSTRAP_TIMEOUT_MS=${LOOM_BOOTSTRAP_TIMEOUT_MS:-60000}
export LOOM_TIMEOUT_MS=${LOOM_TIMEOUT_MS:-20000}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
OUT=${OUT:-/tmp/loom-out}
WORK=${WORK:-/tmp/loom-work}
mkdir -p "$OUT" "$WORK"
for packed in .device-carry/base/*.xz .device-carry/variants/*/*.xz; do
  if [[ -f $packed && ! -f ${packed%.xz} ]]; then xz -dk "$packed"; fi
done
