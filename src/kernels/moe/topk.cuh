// moe_topk: a router's top-k on the device. For every token t, from its E logits:
//   ids[t, 0..k)      the k experts with the largest logits, largest first (equal logits: the
//                     lower expert id first)
//   weights[t, j]     softmax over all E logits at ids[t, j] (kSoftmax), or sigmoid(logit)
//                     (kSigmoid); with `renormalize` divided by the sum of the token's k weights
// Scores are monotonic in the logits, so the selection is on the logits themselves. fp32 math.
//
// One warp per token: its logits are staged in the warp's slice of shared memory (E floats), then
// k rounds of a warp argmax (each lane over experts lane, lane + 32, ...; the winner marked -inf).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/moe/common.cuh"  // lane_id, warp_id

namespace loom::kernels::moe {

struct TopkParams {
  const void* logits;  // [T, E] bf16, fp16 or fp32 (dtype)
  int32_t* ids;        // [T, k]
  float* weights;      // [T, k]
  uint32_t num_tokens, experts, top_k;
  uint32_t dtype;      // loom::DType of the logits
  uint32_t sigmoid;    // 0: softmax over the E logits; 1: sigmoid of each
  uint32_t renormalize;
};

struct TopkTunables {
  static constexpr int kThreads = 256;                 // 8 warps, one token each at a time
  static constexpr int kMaxExperts = 1024;             // E logits per warp in shared memory
  static constexpr int kSmemBytes = kThreads / 32 * kMaxExperts * 4;  // 32 KiB
};

__device__ __forceinline__ float logit_at(const TopkParams& p, uint64_t i) {
  if (p.dtype == 0u) return __bfloat162float(static_cast<const __nv_bfloat16*>(p.logits)[i]);
  if (p.dtype == 1u) return __half2float(static_cast<const __half*>(p.logits)[i]);
  return static_cast<const float*>(p.logits)[i];
}

__global__ void __launch_bounds__(TopkTunables::kThreads) moe_topk_kernel(const TopkParams p) {
  __shared__ float staged[TopkTunables::kThreads / 32][TopkTunables::kMaxExperts];
  const uint32_t lane = lane_id();
  float* v = staged[warp_id()];
  const uint32_t warps = gridDim.x * (blockDim.x / 32);
  const uint32_t e_count = p.experts;
  for (uint32_t t = blockIdx.x * (blockDim.x / 32) + warp_id(); t < p.num_tokens; t += warps) {
    float top = -INFINITY;
    for (uint32_t e = lane; e < e_count; e += 32) {
      v[e] = logit_at(p, static_cast<uint64_t>(t) * e_count + e);
      top = fmaxf(top, v[e]);
    }
    for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
    float denom = 0.0f;  // softmax: sum over all E of exp(l - max)
    if (p.sigmoid == 0u) {
      for (uint32_t e = lane; e < e_count; e += 32) denom += __expf(v[e] - top);
      for (int o = 16; o > 0; o >>= 1) denom += __shfl_xor_sync(0xffffffffu, denom, o);
    }
    __syncwarp();
    float mine_w = 0.0f;  // lane j < k: the weight of slot j
    int32_t mine_id = -1;
    float chosen_sum = 0.0f;
    for (uint32_t j = 0; j < p.top_k; ++j) {
      float best = -INFINITY;
      uint32_t best_e = 0xffffffffu;
      for (uint32_t e = lane; e < e_count; e += 32) {
        if (v[e] > best) {  // strictly: the first (lowest) of equal logits of this lane stays
          best = v[e];
          best_e = e;
        }
      }
      for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const uint32_t oe = __shfl_xor_sync(0xffffffffu, best_e, o);
        if (ob > best || (ob == best && oe < best_e)) {
          best = ob;
          best_e = oe;
        }
      }
      // Every lane holds the winner; its lane marks it taken.
      if (best_e < e_count && best_e % 32 == lane) v[best_e] = -INFINITY;
      __syncwarp();
      const float w = best_e >= e_count ? 0.0f  // fewer than k finite logits: an unused slot
                      : p.sigmoid != 0u      ? 1.0f / (1.0f + __expf(-best))
                                             : __expf(best - top) / denom;
      chosen_sum += w;
      if (lane == j) {
        mine_w = w;
        mine_id = best_e < e_count ? static_cast<int32_t>(best_e) : -1;
      }
    }
    if (lane < p.top_k) {
      const uint64_t q = static_cast<uint64_t>(t) * p.top_k + lane;
      p.ids[q] = mine_id;
      p.weights[q] = p.renormalize != 0u && chosen_sum > 0.0f ? mine_w / chosen_sum : mine_w;
    }
    __syncwarp();  // the next token overwrites v
  }
}

}  // namespace loom::kernels::moe
