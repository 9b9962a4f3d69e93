// A warp's inclusive prefix sum by shuffles (every lane of the warp calls it): the one scan the
// plan and sort kernels of the MoE family build their block-wide scans from.
#pragma once

#include <cstdint>

namespace loom::kernels {

// Lane l gets v(0) + ... + v(l).
template <typename T>
__device__ __forceinline__ T warp_inclusive_sum(T v) {
  const uint32_t lane = threadIdx.x & 31u;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const T below = __shfl_up_sync(0xffffffffu, v, offset);
    if (lane >= static_cast<uint32_t>(offset)) v += below;
  }
  return v;
}

}  // namespace loom::kernels
