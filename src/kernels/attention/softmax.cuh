// The online softmax of one consumer thread's two rows, over the m64nN wgmma accumulator layout.
//
// Accumulator layout (m64nNk16, fp32, one warpgroup): thread lane l of warp w holds, for each
// 8-column chunk j, s[4j + 0..1] = row 16w + l/4, columns 8j + 2(l%4) + {0,1}, and s[4j + 2..3] =
// the same columns of row 16w + l/4 + 8. So element i belongs to row half (i >> 1) & 1, and a
// row's values are spread over the 4 threads of a quad (shuffles with lane masks 1 and 2).
//
// Scores are kept in the base-2 domain: p = exp2(s * scale_log2 - m), with scale_log2 = scale *
// log2(e) folded into one FFMA; m is the running row maximum (lazy: within kMaxGrowthLog2 of
// it) already multiplied by scale_log2.
// The row sum l is kept per thread (a partial over the thread's columns) and reduced over the quad
// only at the end: the rescale factors are per row, so partial sums rescale alike.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace loom::kernels::attention {

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Two 32-bit floats to one register of two 16-bit values (the low half is the first).
template <bool kBF16>
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  if constexpr (kBF16) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// kLazy: the running maximum moves only when a block's maximum exceeds it by more than
// kMaxGrowthLog2 (FlashConfig::kLazyRescale says where that pays).
template <int kN, bool kLazy>
struct OnlineSoftmax {
  static constexpr int kRegs = kN / 2;  // accumulator floats per thread
  static constexpr float kNegInf = -__builtin_huge_valf();
  // Lazy: until a block's maximum exceeds the running one by more than this (base 2), p =
  // exp2(s * scale_log2 - m) stays below 2^8, which the fp32 sums and P's bf16 or fp16 (their
  // relative precision does not depend on the magnitude) hold as well as p <= 1, and O and the
  // sums need no rescale. After a tile's first block most blocks skip it.
  static constexpr float kMaxGrowthLog2 = 8.f;

  float max[2];  // running row maxima (lazy: at most kMaxGrowthLog2 below), times scale_log2 (-inf: no visible key yet)
  float sum[2];  // this thread's partial row sums

  __device__ void reset() {
    max[0] = max[1] = kNegInf;
    sum[0] = sum[1] = 0.f;
  }

  // Turns the scores s (raw Q K^T) of one K block into probabilities p = exp2(s * scale_log2 - m)
  // in place and updates max and sum; returns in `rescale` the factor by which O (and the earlier
  // sum) must be multiplied, and whether either factor may differ from 1 (always true unless
  // lazy). Masked scores are -inf and give p = 0; a row without any visible key so far keeps
  // max = -inf and subtracts 0 instead (no inf - inf); a first visible block always moves it
  // (rescale exp2(-inf) = 0).
  __device__ bool update(float (&s)[kRegs], float scale_log2, float (&rescale)[2]) {
    float block_max[2] = {kNegInf, kNegInf};
#pragma unroll
    for (int i = 0; i < kRegs; ++i) block_max[(i >> 1) & 1] = fmaxf(block_max[(i >> 1) & 1], s[i]);
    float base[2];
    bool moved = !kLazy;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if constexpr (kLazy) {
        const float block = quad_max(block_max[r]) * scale_log2;
        const bool raise = block > max[r] + kMaxGrowthLog2;  // -inf + 8 = -inf: a first visible block raises
        rescale[r] = raise ? fast_exp2(max[r] - block) : 1.f;
        max[r] = raise ? block : max[r];
        base[r] = max[r] == kNegInf ? 0.f : max[r];
        moved |= raise;
      } else {
        const float new_max = fmaxf(max[r], quad_max(block_max[r]) * scale_log2);
        base[r] = new_max == kNegInf ? 0.f : new_max;
        rescale[r] = fast_exp2(max[r] - base[r]);  // exp2(-inf) = 0 on the first visible block
        max[r] = new_max;
      }
      sum[r] *= rescale[r];
    }
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {
      const int r = (i >> 1) & 1;
      s[i] = fast_exp2(fmaf(s[i], scale_log2, -base[r]));
      sum[r] += s[i];
    }
    return moved;
  }

  // The tile's end: 1 / l per row (0 for a row that saw no key) and the natural-log LSE
  // (-inf for such a row). Every thread of a quad gets the same values.
  __device__ void finish(float (&inv_sum)[2], float (&lse)[2]) const {
    constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(sum[r]);
      const bool seen = l > 0.f;
      inv_sum[r] = seen ? 1.f / l : 0.f;
      lse[r] = seen ? (max[r] + __log2f(l)) * kLn2 : kNegInf;
    }
  }
};

// P in registers as the A fragment of the P V wgmma: the m64k16 A fragment of k-step kk holds
// rows (l/4, l/4 + 8) x columns 16kk + 2(l%4) + {0,1} and 16kk + 8 + 2(l%4) + {0,1}, which are
// exactly the accumulator elements 8kk .. 8kk + 7 in order: register i packs s[2i], s[2i + 1].
template <int kN, bool kBF16>
__device__ __forceinline__ void convert_p(const float (&s)[kN / 2], uint32_t (&p)[kN / 4]) {
#pragma unroll
  for (int i = 0; i < kN / 4; ++i) p[i] = pack_half2<kBF16>(s[2 * i], s[2 * i + 1]);
}

}  // namespace loom::kernels::attention
