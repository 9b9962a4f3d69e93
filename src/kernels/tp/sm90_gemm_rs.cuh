// Fused GEMM + ReduceScatter: out[M/W, N] = ReduceScatter_rows(a_r[M, K_r] @ b_r), one persistent
// kernel. Algorithm, buffers and flags: staged_reduce.cuh (shared with gemm_ar).
//
// Roles: every CTA computes (TpRole::kCompute). The partial tiles owed to other ranks leave from
// the compute epilogues (TMA stores into the owner's staging) at the rate tiles finish, so no CTA
// is set aside to move data; the sums happen where the owner's accumulators already are.
#pragma once

#include "kernels/tp/staged_reduce.cuh"

namespace loom::kernels::tp {

template <class Cfg, bool kBF16, bool kBNMajor>
__global__ void __launch_bounds__(Cfg::kThreads, 1) gemm_rs_kernel(const __grid_constant__ ReduceGemmParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  reduce_gemm_body<Cfg, kBF16, kBNMajor, /*kBroadcast=*/false>(p, smem);
}

}  // namespace loom::kernels::tp
