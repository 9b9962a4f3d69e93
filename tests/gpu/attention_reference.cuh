// A plain fp32 attention reference for the tests: one CTA per (query row, head, batch), the row's
// scores in shared memory, a max-subtracted softmax and P V in fp32 (double for the row sum).
// Slow and simple on purpose; it shares no code with the attention engine.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace loom::test {

struct RefAttention {
  const void* q;
  const void* k;
  const void* v;
  float* out;  // [rows, heads_q, D] dense
  float* lse;  // [heads_q, rows] dense
  int64_t q_row, q_head, q_batch;  // element strides
  int64_t k_row, k_head, k_batch;
  int64_t v_row, v_head, v_batch;
  const int32_t* cu_q;  // packed: host-checked offsets on the device; null: batched
  const int32_t* cu_k;
  int32_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim;
  int64_t rows;  // dense reference rows: batch * seqlen_q, or the packed total
  float scale;
  int causal;
  int bf16;
};

static __device__ __forceinline__ float ref_load(const void* p, int64_t i, int bf16) {
  return bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]) : __half2float(static_cast<const __half*>(p)[i]);
}

// grid (rows of the longest sequence, heads_q, batch); dynamic shared memory: seqlen_k floats.
static __global__ void reference_attention(const RefAttention a) {
  extern __shared__ float scores[];
  __shared__ float red[32];
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  int q0 = 0, k0 = 0, len_q = a.seqlen_q, len_k = a.seqlen_k, bc = b;
  if (a.cu_q != nullptr) {
    q0 = a.cu_q[b];
    k0 = a.cu_k[b];
    len_q = a.cu_q[b + 1] - q0;
    len_k = a.cu_k[b + 1] - k0;
    bc = 0;
  }
  if (i >= len_q) return;
  const int hk = h / (a.heads_q / a.heads_kv);
  const int64_t qbase = static_cast<int64_t>(q0 + i) * a.q_row + h * a.q_head + bc * a.q_batch;
  const int limit = a.causal ? min(len_k, i + 1 + len_k - len_q) : len_k;
  float local_max = -__builtin_huge_valf();
  for (int j = threadIdx.x; j < len_k; j += blockDim.x) {
    float s = -__builtin_huge_valf();
    if (j < limit) {
      const int64_t kbase = static_cast<int64_t>(k0 + j) * a.k_row + hk * a.k_head + bc * a.k_batch;
      float acc = 0.f;
      for (int d = 0; d < a.head_dim; ++d) acc += ref_load(a.q, qbase + d, a.bf16) * ref_load(a.k, kbase + d, a.bf16);
      s = acc * a.scale;
    }
    scores[j] = s;
    local_max = fmaxf(local_max, s);
  }
  for (int o = 16; o > 0; o /= 2) local_max = fmaxf(local_max, __shfl_xor_sync(0xffffffffu, local_max, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = local_max;
  __syncthreads();
  float row_max = -__builtin_huge_valf();
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) row_max = fmaxf(row_max, red[w]);
  __syncthreads();
  double local_sum = 0;
  for (int j = threadIdx.x; j < len_k; j += blockDim.x) {
    const float p = row_max == -__builtin_huge_valf() ? 0.f : expf(scores[j] - row_max);
    scores[j] = p;
    local_sum += p;
  }
  float s32 = static_cast<float>(local_sum);
  for (int o = 16; o > 0; o /= 2) s32 += __shfl_xor_sync(0xffffffffu, s32, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = s32;
  __syncthreads();
  float row_sum = 0.f;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) row_sum += red[w];
  // Dense reference rows: batched b * Sq + i, packed q0 + i.
  const int64_t out_row = a.cu_q != nullptr ? static_cast<int64_t>(q0 + i) : static_cast<int64_t>(b) * a.seqlen_q + i;
  for (int d = threadIdx.x; d < a.head_dim; d += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < limit; ++j) {
      const int64_t vbase = static_cast<int64_t>(k0 + j) * a.v_row + hk * a.v_head + bc * a.v_batch;
      acc += scores[j] * ref_load(a.v, vbase + d, a.bf16);
    }
    a.out[(out_row * a.heads_q + h) * a.head_dim + d] = row_sum > 0.f ? acc / row_sum : 0.f;
  }
  if (threadIdx.x == 0) {
    a.lse[static_cast<int64_t>(h) * a.rows + out_row] =
        row_sum > 0.f ? row_max + logf(row_sum) : -__builtin_huge_valf();
  }
}

}  // namespace loom::test
