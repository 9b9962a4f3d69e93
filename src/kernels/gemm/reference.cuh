// Test and benchmark helpers for the GEMM engine (device code): deterministic random inputs
// and an fp32 reference GEMM, independent of the engine (CUDA cores, shared-memory tiles).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace loom::kernels::gemm::reference {

__device__ __forceinline__ float uniform_pm1(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + i * 0xBF58476D1CE4E5B9ull + 0x94D049BB133111EBull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f;  // [-1, 1)
}

// dtype: 0 bf16, 1 fp16, 2 fp32 (loom::DType values). Fills rows x cols with leading dimension ld.
// Element (r, c) is uniform_pm1(seed, r * cols + c) * scale, so a block of rows filled on its own
// equals the same rows of a larger matrix filled from the same seed at offset r0 * cols.
// A template (of nothing) so that several translation units of one program can include this
// header: each instantiation is an inline, mergeable definition.
template <int kUnused = 0>
__global__ void fill_uniform(void* out, int dtype, int64_t rows, int64_t cols, int64_t ld, uint64_t seed, float scale) {
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    const float v = uniform_pm1(seed, static_cast<uint64_t>(i)) * scale;
    if (dtype == 0) static_cast<__nv_bfloat16*>(out)[r * ld + c] = __float2bfloat16(v);
    else if (dtype == 1) static_cast<__half*>(out)[r * ld + c] = __float2half(v);
    else static_cast<float*>(out)[r * ld + c] = v;
  }
}

template <class T>
__device__ __forceinline__ float to_f32(T v) {
  if constexpr (sizeof(T) == 4) return v;
  else if constexpr (__is_same(T, __half)) return __half2float(v);
  else return __bfloat162float(v);
}

// C[i, :] = A[rows[i], :] * B for i < n_rows (rows == nullptr: row i). C is fp32 [n_rows, N].
// B is [K, N] (b_kn) or [N, K], leading dimension ldb. 256 threads per 32 x 32 block of C.
template <class T>
__global__ void __launch_bounds__(256) gemm_fp32(const T* A, const T* B, float* C, const int* rows, int n_rows,
                                                 int N, int K, int64_t lda, int64_t ldb, bool b_kn) {
  __shared__ float as[32][33];
  __shared__ float bs[32][33];  // bs[kk][c]
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  const int row_base = blockIdx.y * 32, col_base = blockIdx.x * 32;
  float acc[4] = {0, 0, 0, 0};
  for (int k0 = 0; k0 < K; k0 += 32) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = ty + 8 * i;
      const int gr = row_base + r;
      float v = 0;
      if (gr < n_rows && k0 + tx < K) {
        const int64_t ar = rows != nullptr ? rows[gr] : gr;
        v = to_f32(A[ar * lda + k0 + tx]);
      }
      as[r][tx] = v;
      if (b_kn) {
        const int kk = ty + 8 * i;
        bs[kk][tx] = (k0 + kk < K && col_base + tx < N) ? to_f32(B[static_cast<int64_t>(k0 + kk) * ldb + col_base + tx]) : 0.f;
      } else {
        const int c = ty + 8 * i;
        bs[tx][c] = (k0 + tx < K && col_base + c < N) ? to_f32(B[static_cast<int64_t>(col_base + c) * ldb + k0 + tx]) : 0.f;
      }
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < 32; ++kk) {
      const float b = bs[kk][tx];
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i] += as[ty + 8 * i][kk] * b;
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = row_base + ty + 8 * i;
    if (r < n_rows && col_base + tx < N) C[static_cast<int64_t>(r) * N + col_base + tx] = acc[i];
  }
}

}  // namespace loom::kernels::gemm::reference
