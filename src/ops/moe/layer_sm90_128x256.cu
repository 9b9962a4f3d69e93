// Instantiations of moe_layer's kernel for the 128x256 tile (bf16 and fp16).
#include "ops/moe/layer_launch.cuh"

namespace loom::ops::detail {

Status launch_sm90_moe_layer_128x256(const kernels::moe::LayerParams& params, bool bf16, int grid, cudaStream_t stream) {
  return launch_layer_config<kernels::gemm::Tile128x256>(params, bf16, grid, stream);
}

Status load_sm90_moe_layer_128x256() { return load_layer_config<kernels::gemm::Tile128x256>(); }

}  // namespace loom::ops::detail
