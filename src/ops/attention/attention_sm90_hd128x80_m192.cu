// The attention kernels of configuration Flash128x80_m192 (head dim x BLOCK_N, three consumer
// warpgroups: 192 query rows per tile; ops/attention/flash_launch.h).
#include "ops/attention/flash_instance.cuh"
#include "ops/attention/flash_launch.h"

namespace loom::ops::attention {

Status launch_flash_128x80_m192(const kernels::attention::FlashParams& p, bool bf16, bool causal, int grid,
                                cudaStream_t stream) {
  return launch_variant<kernels::attention::Flash128x80_m192, FlashKernels>(p, bf16, causal, grid, stream);
}

}  // namespace loom::ops::attention
