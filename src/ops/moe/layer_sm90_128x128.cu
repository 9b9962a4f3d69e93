// Instantiations of moe_layer's kernel for the 128x128 tile (bf16 and fp16).
#include "ops/moe/layer_launch.cuh"

namespace loom::ops::detail {

Status launch_sm90_moe_layer_128x128(const kernels::moe::LayerParams& params, bool bf16, int grid, cudaStream_t stream) {
  return launch_layer_config<kernels::gemm::Tile128x128>(params, bf16, grid, stream);
}

Status load_sm90_moe_layer_128x128() { return load_layer_config<kernels::gemm::Tile128x128>(); }

}  // namespace loom::ops::detail
