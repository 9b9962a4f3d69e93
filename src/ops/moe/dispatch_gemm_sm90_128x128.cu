// Instantiations of moe_dispatch_gemm's kernel for the 128x128 tile
// (bf16 / fp16 inputs, B [E, N, K] / [E, K, N], plain / SwiGLU epilogue).
#include "ops/moe/dispatch_gemm_launch.cuh"

namespace loom::ops::detail {

Status launch_sm90_moe_dispatch_gemm_128x128(const kernels::moe::DispatchGemmParams& params, const GroupedVariant& variant,
                                            int grid, cudaStream_t stream) {
  return launch_dispatch_gemm_config<kernels::gemm::Tile128x128>(params, variant, grid, stream);
}

Status load_sm90_moe_dispatch_gemm_128x128() { return load_grouped_variants<kernels::gemm::Tile128x128, DispatchGemmKernel>(); }

}  // namespace loom::ops::detail
