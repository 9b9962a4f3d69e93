// Helpers shared by the tensor-parallel benches (tp_bench.cu, multinode_bench.cu): owned device,
// symmetric and stream handles, a cuBLAS handle with its workspace, and the random matrices
// every rank can regenerate for its fp32 reference (tests/common/verifiable.cuh's values).
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>

#include "baselines.h"
#include "loom/communicator.h"
#include "loom/status.h"
#include "loom/types.h"
#include "runtime/cuda_check.h"
#include "tests/common/verifiable.cuh"

namespace loom::bench {

// printf-formats one value ("%.3f" and the like).
inline std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof(b), f, v);
  return b;
}

// cudaMalloc'd bytes (at least 16, so a zero-size buffer still has an address), freed on
// destruction or re-allocation.
struct DeviceBuffer {
  void* p = nullptr;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { release(); }
  Status alloc(size_t bytes) {
    release();
    LOOM_CUDA_TRY(cudaMalloc(&p, std::max<size_t>(bytes, 16)));
    return {};
  }
  void release() {
    if (p) cudaFree(p);
    p = nullptr;
  }
};

// A symmetric allocation. Freed in reverse order of allocation on every rank (symmetric
// allocations are collective), which C++ destruction order gives.
struct SymmetricBuffer {
  Communicator* comm = nullptr;
  void* p = nullptr;
  SymmetricBuffer() = default;
  SymmetricBuffer(const SymmetricBuffer&) = delete;
  SymmetricBuffer& operator=(const SymmetricBuffer&) = delete;
  ~SymmetricBuffer() {
    if (p) (void)comm->free(p);
  }
  Status alloc(Communicator& c, size_t bytes) {
    comm = &c;
    LOOM_ASSIGN_OR_RETURN(p, c.alloc(bytes));
    return {};
  }
};

struct StreamHolder {
  cudaStream_t stream = nullptr;
  ~StreamHolder() {
    if (stream) cudaStreamDestroy(stream);
  }
};

// A cuBLAS handle on `stream` with its own 32 MiB workspace.
struct CublasContext {
  cublasHandle_t handle = nullptr;
  DeviceBuffer workspace;
  ~CublasContext() {
    if (handle) cublasDestroy(handle);
  }
  Status init(cudaStream_t stream) {
    LOOM_TRY(cublas_status(cublasCreate(&handle), "cublasCreate"));
    const size_t bytes = size_t{32} << 20;
    LOOM_TRY(workspace.alloc(bytes));
    LOOM_TRY(cublas_status(cublasSetStream(handle, stream), "cublasSetStream"));
    return cublas_status(cublasSetWorkspace(handle, workspace.p, bytes), "cublasSetWorkspace");
  }
};

template <typename T>
__global__ void fill_matrix_kernel(T* out, int64_t rows, int64_t cols, int64_t ld, uint64_t seed, int rank) {
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    out[r * ld + c] = verify::from_float<T>(verify::element_value(seed, rank, static_cast<uint64_t>(i)));
  }
}

// rows x cols at `out` (leading dimension ld), bf16 or fp16: element (r, c) is rank `rank`'s
// value r*cols + c of the seed's sequence.
inline Status fill_matrix(void* out, DType t, int64_t rows, int64_t cols, int64_t ld, uint64_t seed, int rank,
                          cudaStream_t s) {
  const unsigned grid = verify::grid_for(static_cast<uint64_t>(rows * cols));
  if (t == DType::kBF16) {
    fill_matrix_kernel<<<grid, 256, 0, s>>>(static_cast<__nv_bfloat16*>(out), rows, cols, ld, seed, rank);
  } else {
    fill_matrix_kernel<<<grid, 256, 0, s>>>(static_cast<__half*>(out), rows, cols, ld, seed, rank);
  }
  LOOM_CUDA_TRY_LAUNCH();
  return {};
}

inline void* offset_elements(void* p, int64_t elements, DType t) {
  return static_cast<char*>(p) + elements * static_cast<int64_t>(dtype_size(t));
}

}  // namespace loom::bench
