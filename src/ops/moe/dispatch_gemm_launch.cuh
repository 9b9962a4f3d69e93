// Instantiates moe_dispatch_gemm's kernel (kernels/moe/dispatch_gemm.cuh) for one tile
// configuration through the grouped GEMM's variant table (bf16 / fp16 x B layout x plain /
// SwiGLU). Included by exactly one dispatch_gemm_sm90_<tile>.cu each (the instantiations are heavy).
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/moe/dispatch_gemm.cuh"
#include "loom/status.h"
#include "ops/moe/grouped_gemm_dispatch.cuh"

namespace loom::ops::detail {

template <class Cfg, bool kBF16, bool kBNMajor, bool kGated>
struct DispatchGemmKernel {
  static constexpr auto value = &kernels::moe::moe_dispatch_gemm_kernel<Cfg, kBF16, kBNMajor, kGated>;
};

template <class Cfg>
Status launch_dispatch_gemm_config(const kernels::moe::DispatchGemmParams& params, const GroupedVariant& v, int grid,
                                   cudaStream_t stream) {
  return launch_grouped_variant<Cfg, DispatchGemmKernel>(params, v, grid, stream, "moe_dispatch_gemm");
}

// Defined in dispatch_gemm_sm90_<tile>.cu (the tiles of planner::kDispatchGemmTiles), with a
// loader of that tile's variants each.
Status load_sm90_moe_dispatch_gemm_128x256();
Status load_sm90_moe_dispatch_gemm_128x128();
Status launch_sm90_moe_dispatch_gemm_128x256(const kernels::moe::DispatchGemmParams&, const GroupedVariant&, int, cudaStream_t);
Status launch_sm90_moe_dispatch_gemm_128x128(const kernels::moe::DispatchGemmParams&, const GroupedVariant&, int, cudaStream_t);

}  // namespace loom::ops::detail
