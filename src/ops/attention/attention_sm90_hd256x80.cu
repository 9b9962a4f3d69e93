// The attention kernels of configuration Flash256x80 (head dim x BLOCK_N; ops/attention/flash_launch.h).
#include "ops/attention/flash_instance.cuh"
#include "ops/attention/flash_launch.h"

namespace loom::ops::attention {

Status launch_flash_256x80(const kernels::attention::FlashParams& p, bool bf16, bool causal, int grid, cudaStream_t stream) {
  return launch_variant<kernels::attention::Flash256x80, FlashKernels>(p, bf16, causal, grid, stream);
}

}  // namespace loom::ops::attention
