// What the benchmark drivers share for their NCCL and cuBLAS baselines and host-side checks.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>

#include "loom/gemm.h"
#include "loom/status.h"
#include "loom/types.h"

namespace loom::bench {

Status cublas_status(cublasStatus_t s, const char* what);
cudaDataType_t cuda_type(DType t);
ncclDataType_t nccl_type(DType t);

// Row-major D[m, n] = A[m, k] * B with cuBLAS (column-major): D^T = op(B') * A'. B [K, N] is
// (n x k, ld n) column-major, op N; B [N, K] is (k x n, ld k), op T. fp32 accumulation.
Status cublas_gemm(cublasHandle_t h, const void* a, const void* b, void* d, int64_t m, int64_t n, int64_t k,
                   BLayout layout, DType in_dtype, DType out_dtype);

// Element i of a host copy of bf16 / fp16 / fp32 data, as a float.
float host_value(const void* data, size_t i, DType t);

}  // namespace loom::bench
