// The multi-node gemm_rs kernels (ops/tp/multinode/reduce.h).
#include "ops/tp/multinode/reduce.h"

namespace loom::ops::tp::multinode {
template Result<ReduceKernel> reduce_kernel<false>(GemmTile, DType, BLayout);
template Status load_reduce_kernels<false>();
}  // namespace loom::ops::tp::multinode
