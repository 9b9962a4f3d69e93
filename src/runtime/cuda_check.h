// CUDA runtime errors as loom::Status.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "loom/status.h"

namespace loom {

// "cudaMalloc(&p, bytes): out of memory (cudaErrorMemoryAllocation) at heap.cc:42"
// ok for cudaSuccess, else a cuda_error Status naming the call and where it was made.
Status cuda_status(cudaError_t err, const char* expr, const char* file, int line);

}  // namespace loom

// Evaluates a CUDA runtime call; on failure returns a cuda_error Status naming the call.
#define LOOM_CUDA_TRY(expr)                                                          \
  do {                                                                               \
    cudaError_t loom_cuda_err_ = (expr);                                             \
    if (loom_cuda_err_ != cudaSuccess) return ::loom::cuda_status(loom_cuda_err_, #expr, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: reports launch-configuration errors as a Status.
#define LOOM_CUDA_TRY_LAUNCH() LOOM_CUDA_TRY(cudaGetLastError())
