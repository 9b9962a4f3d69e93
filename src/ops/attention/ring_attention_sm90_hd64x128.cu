// The ring attention kernels of configuration Flash64x128 (ops/attention/flash_launch.h).
#include "ops/attention/ring_instance.cuh"
#include "ops/attention/flash_launch.h"

namespace loom::ops::attention {

Status launch_ring_64x128(const kernels::attention::RingParams& p, bool bf16, bool causal, int grid, cudaStream_t stream) {
  return launch_variant<kernels::attention::Flash64x128, RingKernels>(p, bf16, causal, grid, stream);
}

Status load_ring_64x128() { return load_variants<kernels::attention::Flash64x128, RingKernels>(); }

}  // namespace loom::ops::attention
