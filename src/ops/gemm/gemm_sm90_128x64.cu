// Instantiations of the standalone GEMM kernel for the 128x64 tile (bf16/fp16 x B [K,N]/[N,K]).
#include "ops/gemm/gemm_dispatch.cuh"

namespace loom::ops::detail {

Status launch_sm90_gemm_128x64(const kernels::gemm::GemmKernelParams& params, bool bf16, bool b_n_major, int grid,
                            cudaStream_t stream) {
  return launch_config<kernels::gemm::Tile128x64>(params, bf16, b_n_major, grid, stream);
}

}  // namespace loom::ops::detail
