// The multi-node gemm_rs and gemm_ar kernels (kernels/tp/multinode/sm90_reduce.cuh) of every
// configuration; gemm_rs.cu and gemm_ar.cu instantiate 8 each, so that no translation unit takes
// long on 2 cores. Their launches are reduce.cu's.
#pragma once

#include "kernels/tp/multinode/sm90_reduce.cuh"
#include "loom/gemm.h"
#include "loom/status.h"
#include "loom/types.h"
#include "ops/launch/kernel_launch.h"
#include "ops/tp/fused_kernel.h"

namespace loom::ops::tp::multinode {

using ReduceKernel = FusedKernel<kernels::tp::multinode::ReduceParams>;

template <bool kAllReduce>
struct ReduceKernelOf {
  template <class Cfg, bool kBF16, bool kBNMajor>
  auto operator()() const {
    if constexpr (kAllReduce) {
      return &kernels::tp::multinode::gemm_ar_kernel<Cfg, kBF16, kBNMajor>;
    } else {
      return &kernels::tp::multinode::gemm_rs_kernel<Cfg, kBF16, kBNMajor>;
    }
  }
};

// The kernel of gemm_rs (kAllReduce = false) or gemm_ar for a configuration.
template <bool kAllReduce>
Result<ReduceKernel> reduce_kernel(GemmTile tile, DType dtype, BLayout layout) {
  return fused_kernel<kernels::tp::multinode::ReduceParams>(tile, dtype, layout, ReduceKernelOf<kAllReduce>{});
}

// Loads the operator's kernels (multinode.h, load_kernels, says why).
template <bool kAllReduce>
Status load_reduce_kernels() {
  return for_each_fused_kernel<kernels::tp::multinode::ReduceParams>(ReduceKernelOf<kAllReduce>{}, [](const ReduceKernel& k) {
    return prepare_kernel(reinterpret_cast<const void*>(k.fn), k.smem_bytes);
  });
}

extern template Result<ReduceKernel> reduce_kernel<false>(GemmTile, DType, BLayout);  // gemm_rs.cu
extern template Status load_reduce_kernels<false>();
extern template Result<ReduceKernel> reduce_kernel<true>(GemmTile, DType, BLayout);  // gemm_ar.cu
extern template Status load_reduce_kernels<true>();

}  // namespace loom::ops::tp::multinode
