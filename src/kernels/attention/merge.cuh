// attention_merge's kernel: n partial results over disjoint key sets, each O_i (fp32, divided by
// its own row sum) with its natural-log LSE_i, combined in fp32:
//   lse = m + log sum_i exp(lse_i - m)   (m = max_i lse_i),   O = sum_i exp(lse_i - lse) O_i.
// A row whose partials all saw no key (every lse_i = -inf) gets O = 0 and lse = -inf.
// One thread per 4 columns of one (batch, seq, head) row: grid-stride over rows x head_dim / 4.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace loom::kernels::attention {

struct MergeParams {
  const float* partial_out;  // [n, batch, seq, heads, head_dim]
  const float* partial_lse;  // [n, batch, heads, seq]
  void* out;                 // [batch, seq, heads, head_dim] in out_dtype
  float* lse;                // [batch, heads, seq] or null
  int64_t num_partials, batch, seqlen, heads, head_dim;
  uint32_t out_dtype;  // loom::DType
};

template <int kOutDType>  // 0 bf16, 1 fp16, 2 fp32 (loom::DType order)
__global__ void attention_merge_kernel(const MergeParams p) {
  const int64_t rows = p.batch * p.seqlen * p.heads;  // in out's order: (b, s, h)
  const int64_t quads = p.head_dim / 4;
  const int64_t part_stride = rows * p.head_dim;
  const int64_t total = rows * quads;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / quads, quad = idx % quads;
    const int64_t h = row % p.heads, s = (row / p.heads) % p.seqlen, b = row / (p.heads * p.seqlen);
    const int64_t lse_index = (b * p.heads + h) * p.seqlen + s;
    float m = -__builtin_huge_valf();
    for (int64_t i = 0; i < p.num_partials; ++i) m = fmaxf(m, p.partial_lse[i * rows + lse_index]);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float sum = 0.f;
    if (m != -__builtin_huge_valf()) {
      for (int64_t i = 0; i < p.num_partials; ++i) {
        const float w = __expf(p.partial_lse[i * rows + lse_index] - m);
        sum += w;
        const float4 o = *reinterpret_cast<const float4*>(p.partial_out + i * part_stride + row * p.head_dim + 4 * quad);
        acc.x += w * o.x;
        acc.y += w * o.y;
        acc.z += w * o.z;
        acc.w += w * o.w;
      }
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const float r[4] = {acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv};
    const int64_t at = row * p.head_dim + 4 * quad;
    if constexpr (kOutDType == 2) {
      *reinterpret_cast<float4*>(static_cast<float*>(p.out) + at) = make_float4(r[0], r[1], r[2], r[3]);
    } else if constexpr (kOutDType == 0) {
      __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p.out) + at);
      o[0] = __floats2bfloat162_rn(r[0], r[1]);
      o[1] = __floats2bfloat162_rn(r[2], r[3]);
    } else {
      __half2* o = reinterpret_cast<__half2*>(static_cast<__half*>(p.out) + at);
      o[0] = __floats2half2_rn(r[0], r[1]);
      o[1] = __floats2half2_rn(r[2], r[3]);
    }
    if (p.lse != nullptr && quad == 0) p.lse[lse_index] = sum > 0.f ? m + __logf(sum) : -__builtin_huge_valf();
  }
}

}  // namespace loom::kernels::attention
