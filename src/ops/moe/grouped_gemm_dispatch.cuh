// Instantiates the grouped GEMM kernel for one tile configuration (bf16 / fp16 x B [E, N, K] /
// [E, K, N] x plain / SwiGLU epilogue) and launches the variant a call needs.
// Included by exactly one grouped_gemm_sm90_<tile>.cu each, so the heavy instantiations are
// spread over several translation units (CI compiles on 2 cores).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <string>

#include "kernels/moe/grouped_gemm.cuh"
#include "loom/status.h"
#include "ops/launch/kernel_launch.h"

namespace loom::ops::detail {

// Which kernel of a configuration a call needs.
struct GroupedVariant {
  bool bf16;     // A and B bf16 (else fp16)
  bool n_major;  // B is [E, K, N] (BLayout::kKN) rather than [E, N, K]
  bool swiglu;   // the SwiGLU epilogue (GroupedActivation::kSwiGLU)
};

template <class Cfg>
Status launch_grouped_config(const kernels::moe::GroupedGemmKernelParams& params, const GroupedVariant& v, int grid,
                             cudaStream_t stream) {
  namespace km = kernels::moe;
  using Kernel = void (*)(km::GroupedGemmKernelParams);
  // The SwiGLU epilogue needs BLOCK_N >= 128 (planner::kSwiGluMinBlockN): no such kernels below it.
  constexpr bool kGated = Cfg::kBlockN >= 128;
  constexpr std::array<Kernel, 4> kPlain{
      &km::sm90_grouped_gemm_kernel<Cfg, true, false, false>, &km::sm90_grouped_gemm_kernel<Cfg, true, true, false>,
      &km::sm90_grouped_gemm_kernel<Cfg, false, false, false>, &km::sm90_grouped_gemm_kernel<Cfg, false, true, false>};
  const size_t index = (v.bf16 ? 0 : 2) + (v.n_major ? 1 : 0);
  Kernel kernel = kPlain[index];
  if (v.swiglu) {
    if constexpr (kGated) {
      constexpr std::array<Kernel, 4> kSwiGlu{
          &km::sm90_grouped_gemm_kernel<Cfg, true, false, true>, &km::sm90_grouped_gemm_kernel<Cfg, true, true, true>,
          &km::sm90_grouped_gemm_kernel<Cfg, false, false, true>, &km::sm90_grouped_gemm_kernel<Cfg, false, true, true>};
      kernel = kSwiGlu[index];
    } else {
      return Status::internal("grouped_gemm: no SwiGLU kernel for BLOCK_N " + std::to_string(Cfg::kBlockN));
    }
  }
  return launch_kernel(kernel, static_cast<unsigned>(grid), Cfg::kThreads, Cfg::kSmemBytes, stream, params);
}

// Defined in grouped_gemm_sm90_<tile>.cu.
Status launch_sm90_grouped_gemm_128x256(const kernels::moe::GroupedGemmKernelParams&, const GroupedVariant&, int, cudaStream_t);
Status launch_sm90_grouped_gemm_128x128(const kernels::moe::GroupedGemmKernelParams&, const GroupedVariant&, int, cudaStream_t);
Status launch_sm90_grouped_gemm_128x64(const kernels::moe::GroupedGemmKernelParams&, const GroupedVariant&, int, cudaStream_t);
Status launch_sm90_grouped_gemm_64x128(const kernels::moe::GroupedGemmKernelParams&, const GroupedVariant&, int, cudaStream_t);

}  // namespace loom::ops::detail
