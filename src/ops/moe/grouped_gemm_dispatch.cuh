// Instantiates the grouped GEMM kernel for one tile configuration (bf16 / fp16 x B [E, N, K] /
// [E, K, N]) and launches the variant a call needs.
// Included by exactly one grouped_gemm_sm90_<tile>.cu each, so the heavy instantiations are
// spread over several translation units (CI compiles on 2 cores).
#pragma once

#include <cuda_runtime_api.h>

#include <array>

#include "kernels/moe/grouped_gemm.cuh"
#include "loom/status.h"
#include "ops/launch/kernel_launch.h"

namespace loom::ops::detail {

// n_major: B is [E, K, N] (BLayout::kKN) rather than [E, N, K].
template <class Cfg>
Status launch_grouped_config(const kernels::moe::GroupedGemmKernelParams& params, bool bf16, bool n_major, int grid,
                             cudaStream_t stream) {
  namespace km = kernels::moe;
  constexpr std::array<void (*)(km::GroupedGemmKernelParams), 4> kVariants{
      &km::sm90_grouped_gemm_kernel<Cfg, true, false>, &km::sm90_grouped_gemm_kernel<Cfg, true, true>,
      &km::sm90_grouped_gemm_kernel<Cfg, false, false>, &km::sm90_grouped_gemm_kernel<Cfg, false, true>};
  return launch_kernel(kVariants[(bf16 ? 0 : 2) + (n_major ? 1 : 0)], static_cast<unsigned>(grid), Cfg::kThreads,
                       Cfg::kSmemBytes, stream, params);
}

// Defined in grouped_gemm_sm90_<tile>.cu.
Status launch_sm90_grouped_gemm_128x256(const kernels::moe::GroupedGemmKernelParams&, bool, bool, int, cudaStream_t);
Status launch_sm90_grouped_gemm_128x128(const kernels::moe::GroupedGemmKernelParams&, bool, bool, int, cudaStream_t);
Status launch_sm90_grouped_gemm_128x64(const kernels::moe::GroupedGemmKernelParams&, bool, bool, int, cudaStream_t);
Status launch_sm90_grouped_gemm_64x128(const kernels::moe::GroupedGemmKernelParams&, bool, bool, int, cudaStream_t);

}  // namespace loom::ops::detail
