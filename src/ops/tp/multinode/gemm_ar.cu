// The multi-node gemm_ar kernels (ops/tp/multinode/reduce.h).
#include "ops/tp/multinode/reduce.h"

namespace loom::ops::tp::multinode {
template Result<ReduceKernel> reduce_kernel<true>(GemmTile, DType, BLayout);
template Status load_reduce_kernels<true>();
}  // namespace loom::ops::tp::multinode
