// Fused GEMM + AllReduce: out[M, N] = AllReduce(a_r[M, K_r] @ b_r) on every rank, one persistent
// kernel. Algorithm, buffers and flags: staged_reduce.cuh (shared with gemm_rs). Beyond gemm_rs:
// each owner stores its reduced tiles into every rank's out (out is symmetric; one TMA store per
// rank from the same staged box) and sets final[tile] on every peer; the launch ends when this
// rank has seen every final tile of the other owners, so out is complete and bit-identical on
// all ranks (each element is rounded once, by its owner).
//
// Roles: every CTA computes (TpRole::kCompute); communication leaves from the epilogues.
#pragma once

#include "kernels/tp/staged_reduce.cuh"

namespace loom::kernels::tp {

template <class Cfg, bool kBF16, bool kBNMajor>
__global__ void __launch_bounds__(Cfg::kThreads, 1) gemm_ar_kernel(const __grid_constant__ ReduceGemmParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  reduce_gemm_body<Cfg, kBF16, kBNMajor, /*kBroadcast=*/true>(p, smem);
}

}  // namespace loom::kernels::tp
