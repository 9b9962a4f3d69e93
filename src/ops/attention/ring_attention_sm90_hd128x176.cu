// The ring attention kernels of configuration Flash128x176 (ops/attention/flash_launch.h).
#include "ops/attention/ring_instance.cuh"
#include "ops/attention/flash_launch.h"

namespace loom::ops::attention {

Status launch_ring_128x176(const kernels::attention::RingParams& p, bool bf16, bool causal, int grid, cudaStream_t stream) {
  return launch_variant<kernels::attention::Flash128x176, RingKernels>(p, bf16, causal, grid, stream);
}

Status load_ring_128x176() { return load_variants<kernels::attention::Flash128x176, RingKernels>(); }

}  // namespace loom::ops::attention
