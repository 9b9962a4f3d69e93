// Instantiates the standalone GEMM kernel for one tile configuration (bf16/fp16 x B layout) and
// launches it. Included by exactly one gemm_sm90_<tile>.cu each, so the heavy instantiations are
// spread over several translation units.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/gemm/sm90_gemm.cuh"
#include "loom/status.h"
#include "ops/launch/kernel_launch.h"
#include "runtime/cuda_check.h"

namespace loom::ops::detail {

template <class Cfg, bool kBF16, bool kBNMajor>
Status launch_instance(const kernels::gemm::GemmKernelParams& params, int grid, cudaStream_t stream) {
  return launch_kernel(&kernels::gemm::sm90_gemm_kernel<Cfg, kBF16, kBNMajor>, static_cast<unsigned>(grid), Cfg::kThreads,
                       Cfg::kSmemBytes, stream, params);
}

template <class Cfg>
Status launch_config(const kernels::gemm::GemmKernelParams& params, bool bf16, bool b_n_major, int grid,
                     cudaStream_t stream) {
  if (bf16) {
    return b_n_major ? launch_instance<Cfg, true, true>(params, grid, stream)
                     : launch_instance<Cfg, true, false>(params, grid, stream);
  }
  return b_n_major ? launch_instance<Cfg, false, true>(params, grid, stream)
                   : launch_instance<Cfg, false, false>(params, grid, stream);
}

// Defined in gemm_sm90_<tile>.cu.
Status launch_sm90_gemm_128x256(const kernels::gemm::GemmKernelParams&, bool, bool, int, cudaStream_t);
Status launch_sm90_gemm_128x128(const kernels::gemm::GemmKernelParams&, bool, bool, int, cudaStream_t);
Status launch_sm90_gemm_128x64(const kernels::gemm::GemmKernelParams&, bool, bool, int, cudaStream_t);
Status launch_sm90_gemm_64x128(const kernels::gemm::GemmKernelParams&, bool, bool, int, cudaStream_t);

}  // namespace loom::ops::detail
