// Instantiates the grouped GEMM kernel for one tile configuration (bf16 / fp16) and launches it.
// Included by exactly one grouped_gemm_sm90_<tile>.cu each, so the heavy instantiations are
// spread over several translation units (CI compiles on 2 cores).
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/moe/grouped_gemm.cuh"
#include "loom/status.h"
#include "ops/launch/kernel_launch.h"

namespace loom::ops::detail {

template <class Cfg>
Status launch_grouped_config(const kernels::moe::GroupedGemmKernelParams& params, bool bf16, int grid,
                             cudaStream_t stream) {
  if (bf16) {
    return launch_kernel(&kernels::moe::sm90_grouped_gemm_kernel<Cfg, true>, static_cast<unsigned>(grid), Cfg::kThreads,
                         Cfg::kSmemBytes, stream, params);
  }
  return launch_kernel(&kernels::moe::sm90_grouped_gemm_kernel<Cfg, false>, static_cast<unsigned>(grid), Cfg::kThreads,
                       Cfg::kSmemBytes, stream, params);
}

// Defined in grouped_gemm_sm90_<tile>.cu.
Status launch_sm90_grouped_gemm_128x256(const kernels::moe::GroupedGemmKernelParams&, bool, int, cudaStream_t);
Status launch_sm90_grouped_gemm_128x128(const kernels::moe::GroupedGemmKernelParams&, bool, int, cudaStream_t);
Status launch_sm90_grouped_gemm_128x64(const kernels::moe::GroupedGemmKernelParams&, bool, int, cudaStream_t);
Status launch_sm90_grouped_gemm_64x128(const kernels::moe::GroupedGemmKernelParams&, bool, int, cudaStream_t);

}  // namespace loom::ops::detail
