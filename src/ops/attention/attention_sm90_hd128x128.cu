// The attention kernels of configuration Flash128x128 (head dim x BLOCK_N; ops/attention/flash_launch.h).
#include "ops/attention/flash_instance.cuh"
#include "ops/attention/flash_launch.h"

namespace loom::ops::attention {

Status launch_flash_128x128(const kernels::attention::FlashParams& p, bool bf16, bool causal, int grid, cudaStream_t stream) {
  return launch_variant<kernels::attention::Flash128x128, FlashKernels>(p, bf16, causal, grid, stream);
}

}  // namespace loom::ops::attention
