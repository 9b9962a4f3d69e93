// What the attention tests share: device buffers, N(0, 1) inputs in bf16/fp16, NaN poisoning.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "loom/types.h"
#include "tests/gpu/common/hopper.h"

namespace loom::test {

struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  DevBuf() = default;
  explicit DevBuf(size_t n) : bytes(n) {
    if (n > 0 && cudaMalloc(&p, n) != cudaSuccess) p = nullptr;
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  DevBuf& operator=(DevBuf&& o) noexcept {
    if (this != &o) {
      if (p) cudaFree(p);
      p = o.p;
      bytes = o.bytes;
      o.p = nullptr;
      o.bytes = 0;
    }
    return *this;
  }
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

inline uint16_t to_half_bits(float f, DType t) {
  if (t == DType::kBF16) {
    const __nv_bfloat16 b = __float2bfloat16(f);
    return *reinterpret_cast<const uint16_t*>(&b);
  }
  const __half h = __float2half(f);
  return *reinterpret_cast<const uint16_t*>(&h);
}
inline float from_half_bits(uint16_t v, DType t) {
  if (t == DType::kBF16) {
    uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  __half_raw r;
  r.x = v;
  return __half2float(__half(r));
}

// A device tensor of `elems` 16-bit values ~ N(0, 1).
inline void fill_normal(DevBuf& buf, size_t elems, DType t, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint16_t> h(elems);
  for (auto& x : h) x = to_half_bits(normal(rng), t);
  cudaMemcpy(buf.p, h.data(), elems * 2, cudaMemcpyHostToDevice);
}
inline void fill_nan(DevBuf& buf) { cudaMemset(buf.p, 0xff, buf.bytes); }  // 0xffff.. is NaN in bf16, fp16 and fp32

}  // namespace loom::test
