// Verifiable data for collectives (nccl-tests style): every rank's input is a pure function of
// (seed, rank, index), so any rank can recompute what every other rank sent and check its
// output on the GPU, bit for bit, at any size. Shared by loom_gpu_tests and loom-bench.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>

#include "loom/types.h"

namespace loom {

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<__nv_bfloat16>() { return DType::kBF16; }
template <> constexpr DType dtype_of<__half>() { return DType::kF16; }
template <> constexpr DType dtype_of<float>() { return DType::kF32; }

}  // namespace loom

namespace loom::verify {

__host__ __device__ inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__host__ __device__ inline uint64_t element_hash(uint64_t seed, int rank, uint64_t index) {
  return mix64(seed ^ mix64(static_cast<uint64_t>(rank) * 0x100000001B3ull ^ mix64(index)));
}

// A value in [-1, 1) with 12 significant bits: exact in every element type, and varied enough
// that a misplaced element is caught.
__host__ __device__ inline float element_value(uint64_t seed, int rank, uint64_t index) {
  const uint64_t h = element_hash(seed, rank, index);
  return static_cast<float>(static_cast<int64_t>(h >> 52) - 2048) / 2048.0f;
}

template <typename T> __device__ inline T from_float(float x);
template <> __device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ inline __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ inline float from_float<float>(float x) { return x; }
template <typename T> __device__ inline float to_float(T x) { return static_cast<float>(x); }
template <> __device__ inline float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ inline float to_float<__half>(__half x) { return __half2float(x); }

template <typename T> __device__ inline uint32_t bits_of(T x) {
  uint32_t b = 0;
  memcpy(&b, &x, sizeof(T));
  return b;
}

// Arbitrary bit patterns (data movement only: NaNs and infinities included on purpose).
template <typename T>
__global__ void fill_bits_kernel(T* out, uint64_t n, uint64_t seed, int rank) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n; i += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t h = element_hash(seed, rank, i);
    T v;
    memcpy(&v, &h, sizeof(T));
    out[i] = v;
  }
}

template <typename T>
__global__ void fill_values_kernel(T* out, uint64_t n, uint64_t seed, int rank) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n; i += uint64_t{gridDim.x} * blockDim.x) {
    out[i] = from_float<T>(element_value(seed, rank, i));
  }
}

// A rows x cols matrix at `out` (leading dimension ld): element (r, c) is rank `rank`'s value
// r*cols + c, so a rank's packed operand and the same block inside a larger reference matrix hold
// equal values (the TP GPU tests and loom-bench's TP reference check).
template <typename T>
__global__ void fill_matrix_kernel(T* out, int64_t rows, int64_t cols, int64_t ld, uint64_t seed, int rank) {
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    out[r * ld + c] = from_float<T>(element_value(seed, rank, static_cast<uint64_t>(i)));
  }
}

struct Mismatch {
  unsigned long long wrong;
  unsigned long long first;  // index of the smallest wrong element (~0 when none)
  uint32_t got;
  uint32_t want;
};

__device__ inline void record_mismatch(Mismatch* m, uint64_t i, uint32_t got, uint32_t want) {
  atomicAdd(&m->wrong, 1ull);
  if (atomicMin(&m->first, static_cast<unsigned long long>(i)) > i) {
    m->got = got;  // racy between equal-first writers only; good enough for a diagnostic
    m->want = want;
  }
}

// recv[s * count + i] must equal rank s's fill_bits(seed) element i.
template <typename T>
__global__ void check_all_gather_kernel(const T* recv, uint64_t count, int world, uint64_t seed, Mismatch* m) {
  const uint64_t n = count * static_cast<uint64_t>(world);
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n; i += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t h = element_hash(seed, static_cast<int>(i / count), i % count);
    T want;
    memcpy(&want, &h, sizeof(T));
    if (bits_of(recv[i]) != bits_of(want)) record_mismatch(m, i, bits_of(recv[i]), bits_of(want));
  }
}

// out[i] must equal the fp32 sum, in rank order, of every rank's fill_values(seed) element
// (index_base + i), rounded once to T.
template <typename T>
__global__ void check_sum_kernel(const T* out, uint64_t n, uint64_t index_base, int world, uint64_t seed, Mismatch* m) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n; i += uint64_t{gridDim.x} * blockDim.x) {
    float acc = 0.0f;
    for (int s = 0; s < world; ++s) acc += to_float(from_float<T>(element_value(seed, s, index_base + i)));
    const T want = from_float<T>(acc);
    if (bits_of(out[i]) != bits_of(want)) record_mismatch(m, i, bits_of(out[i]), bits_of(want));
  }
}

inline unsigned grid_for(uint64_t n) {
  const uint64_t blocks = (n + 255) / 256;
  return static_cast<unsigned>(blocks < 4096 ? (blocks == 0 ? 1 : blocks) : 4096);
}

// Host helpers (synchronous on `stream`; return false on a CUDA error).
template <typename T>
bool fill_bits(T* out, uint64_t n, uint64_t seed, int rank, cudaStream_t stream) {
  fill_bits_kernel<T><<<grid_for(n), 256, 0, stream>>>(out, n, seed, rank);
  return cudaGetLastError() == cudaSuccess;
}

template <typename T>
bool fill_values(T* out, uint64_t n, uint64_t seed, int rank, cudaStream_t stream) {
  fill_values_kernel<T><<<grid_for(n), 256, 0, stream>>>(out, n, seed, rank);
  return cudaGetLastError() == cudaSuccess;
}

// Runs `launch(Mismatch*)` and returns the result (wrong = ~0 on CUDA failure).
template <typename Launch>
Mismatch run_check(cudaStream_t stream, Launch&& launch) {
  Mismatch init{0, ~0ull, 0, 0};
  Mismatch result{~0ull, ~0ull, 0, 0};
  Mismatch* d = nullptr;
  if (cudaMalloc(&d, sizeof(Mismatch)) != cudaSuccess) return result;
  if (cudaMemcpyAsync(d, &init, sizeof(init), cudaMemcpyHostToDevice, stream) == cudaSuccess) {
    launch(d);
    if (cudaGetLastError() == cudaSuccess &&
        cudaMemcpyAsync(&result, d, sizeof(result), cudaMemcpyDeviceToHost, stream) == cudaSuccess &&
        cudaStreamSynchronize(stream) == cudaSuccess) {
      cudaFree(d);
      return result;
    }
  }
  cudaFree(d);
  return Mismatch{~0ull, ~0ull, 0, 0};
}

template <typename T>
Mismatch check_all_gather(const T* recv, uint64_t count, int world, uint64_t seed, cudaStream_t stream) {
  return run_check(stream, [&](Mismatch* m) {
    check_all_gather_kernel<T><<<grid_for(count * world), 256, 0, stream>>>(recv, count, world, seed, m);
  });
}

template <typename T>
Mismatch check_sum(const T* out, uint64_t n, uint64_t index_base, int world, uint64_t seed, cudaStream_t stream) {
  return run_check(stream, [&](Mismatch* m) {
    check_sum_kernel<T><<<grid_for(n), 256, 0, stream>>>(out, n, index_base, world, seed, m);
  });
}

}  // namespace loom::verify
