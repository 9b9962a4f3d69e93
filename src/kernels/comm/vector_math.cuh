// 16-byte vectors of bf16 / fp16 / fp32 elements, accumulated in fp32.
//
// Reductions add in fp32 in a fixed order (rank 0, 1, ..., W-1) and round once to the element
// type, so every rank computes bit-identical results and tests can compare bit for bit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace loom::kernels {

// The fp32 conversions of the 16-bit types, overloaded on bf16 and fp16 so that Vec16 is written
// once for both.
__device__ __forceinline__ float2 widen_pair(__nv_bfloat162 p) { return __bfloat1622float2(p); }
__device__ __forceinline__ float2 widen_pair(__half2 p) { return __half22float2(p); }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }
__device__ __forceinline__ void round_pair(float lo, float hi, __nv_bfloat162& out) { out = __floats2bfloat162_rn(lo, hi); }
__device__ __forceinline__ void round_pair(float lo, float hi, __half2& out) { out = __floats2half2_rn(lo, hi); }
__device__ __forceinline__ void round_to(float x, __nv_bfloat16& out) { out = __float2bfloat16_rn(x); }
__device__ __forceinline__ void round_to(float x, __half& out) { out = __float2half_rn(x); }

// bf16 and fp16: a vector is four pairs of elements.
template <typename T>
struct Vec16 {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "Vec16 holds bf16, fp16 or fp32");
  using Pair = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  static constexpr int kElems = 8;
  __device__ static void add(float (&acc)[kElems], const uint4& v) {
    const Pair* p = reinterpret_cast<const Pair*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = widen_pair(p[i]);
      acc[2 * i] += f.x;
      acc[2 * i + 1] += f.y;
    }
  }
  __device__ static uint4 pack(const float (&acc)[kElems]) {
    uint4 v;
    Pair* p = reinterpret_cast<Pair*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) round_pair(acc[2 * i], acc[2 * i + 1], p[i]);
    return v;
  }
  __device__ static float to_float(T x) { return widen(x); }
  __device__ static T from_float(float x) {
    T rounded;
    round_to(x, rounded);
    return rounded;
  }
};

template <>
struct Vec16<float> {
  static constexpr int kElems = 4;
  __device__ static void add(float (&acc)[kElems], const uint4& v) {
    acc[0] += __uint_as_float(v.x);
    acc[1] += __uint_as_float(v.y);
    acc[2] += __uint_as_float(v.z);
    acc[3] += __uint_as_float(v.w);
  }
  __device__ static uint4 pack(const float (&acc)[kElems]) {
    return make_uint4(__float_as_uint(acc[0]), __float_as_uint(acc[1]), __float_as_uint(acc[2]),
                      __float_as_uint(acc[3]));
  }
  __device__ static float to_float(float x) { return x; }
  __device__ static float from_float(float x) { return x; }
};

// Loads from peers bypass L1: the data was written by another GPU and is read once.
__device__ __forceinline__ uint4 load_peer_vector(const uint4* p) { return __ldcg(p); }

// A hint: bring the line holding *p (this GPU's global memory) into L2; takes no register.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

}  // namespace loom::kernels
