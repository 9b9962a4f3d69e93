// The fused gemm_rs and gemm_ar kernels (kernels/tp/sm90_staged_reduce.cuh) of every
// configuration; gemm_rs.cu and gemm_ar.cu instantiate 8 each, so that no translation unit takes
// long on 2 cores. Their plans and launches are staged_reduce.cu's.
#pragma once

#include "kernels/tp/sm90_staged_reduce.cuh"
#include "loom/gemm.h"
#include "loom/status.h"
#include "loom/types.h"
#include "ops/tp/fused_kernel.h"

namespace loom::ops::tp {

using ReduceKernel = FusedKernel<kernels::tp::ReduceGemmParams>;

template <bool kBroadcast>
struct StagedReduceKernelOf {
  template <class Cfg, bool kBF16, bool kBNMajor>
  auto operator()() const {
    return &kernels::tp::gemm_reduce_kernel<Cfg, kBF16, kBNMajor, kBroadcast>;
  }
};

// The kernel of gemm_rs (kBroadcast = false) or gemm_ar for a configuration.
template <bool kBroadcast>
Result<ReduceKernel> staged_reduce_kernel(GemmTile tile, DType dtype, BLayout layout) {
  return fused_kernel<kernels::tp::ReduceGemmParams>(tile, dtype, layout, StagedReduceKernelOf<kBroadcast>{});
}
extern template Result<ReduceKernel> staged_reduce_kernel<false>(GemmTile, DType, BLayout);  // gemm_rs.cu
extern template Result<ReduceKernel> staged_reduce_kernel<true>(GemmTile, DType, BLayout);   // gemm_ar.cu

}  // namespace loom::ops::tp
