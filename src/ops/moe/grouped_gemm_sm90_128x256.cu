// Instantiations of the grouped GEMM kernel for the 128x256 tile
// (bf16 / fp16 inputs, B [E, N, K] / [E, K, N], plain / SwiGLU epilogue).
#include "ops/moe/grouped_gemm_dispatch.cuh"

namespace loom::ops::detail {

Status launch_sm90_grouped_gemm_128x256(const kernels::moe::GroupedGemmKernelParams& params, const GroupedVariant& variant,
                                        int grid, cudaStream_t stream) {
  return launch_grouped_config<kernels::gemm::Tile128x256>(params, variant, grid, stream);
}

Status load_sm90_grouped_gemm_128x256() { return load_grouped_variants<kernels::gemm::Tile128x256, GroupedGemmKernel>(); }

}  // namespace loom::ops::detail
