// The fused gemm_ar kernels (ops/tp/staged_reduce.h).
#include "ops/tp/staged_reduce.h"

namespace loom::ops::tp {
template Result<ReduceKernel> staged_reduce_kernel<true>(GemmTile, DType, BLayout);
}  // namespace loom::ops::tp
