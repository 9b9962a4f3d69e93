// Instantiations of the grouped GEMM kernel for the 64x128 tile
// (bf16 / fp16 inputs, B [E, N, K] / [E, K, N], plain / SwiGLU epilogue).
#include "ops/moe/grouped_gemm_dispatch.cuh"

namespace loom::ops::detail {

Status launch_sm90_grouped_gemm_64x128(const kernels::moe::GroupedGemmKernelParams& params, const GroupedVariant& variant,
                                       int grid, cudaStream_t stream) {
  return launch_grouped_config<kernels::gemm::Tile64x128>(params, variant, grid, stream);
}

Status load_sm90_grouped_gemm_64x128() { return load_grouped_variants<kernels::gemm::Tile64x128, GroupedGemmKernel>(); }

}  // namespace loom::ops::detail
