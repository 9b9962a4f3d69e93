// Host launcher of the multi-node gemm_ar (kernel: kernels/tp/multinode/sm90_reduce.cuh). Instantiates
// its 8 kernels (128x256 / 128x128 x bf16 / fp16 x B layout).
#include "kernels/tp/multinode/sm90_reduce.cuh"
#include "ops/multinode.h"
#include "ops/multinode_common.h"

namespace loom::ops {

Status gemm_ar_multinode(Communicator& comm, const TpGemmArgs& args, cudaStream_t stream, const TpGemmOptions& options) {
  return mn::launch_reduce</*kAllReduce=*/true>(comm, args, stream, options);
}

namespace mn {

Status load_gemm_ar_kernels() {
  // [&]: a lambda with a capture default has no conversion to a function pointer, whose template
  // parameters nvcc would warn cannot be deduced.
  return load_every_config([&]<class Cfg, bool kBF16, bool kBNMajor>() { return reduce_kernel</*kAllReduce=*/true, Cfg, kBF16, kBNMajor>(); });
}

}  // namespace mn

}  // namespace loom::ops
