// Epilogue staging: a consumer warpgroup's fp32 wgmma accumulators (m64nBN layout), converted to
// the output type, through per-warp 128B-swizzled shared-memory boxes (double-buffered) into the
// epilogue object's bulk writes (TileEpilogue: TMA store or reduce-add). Separate from the
// compute role so that any kernel holding wgmma accumulators (an attention kernel's output tile)
// stages them the same way; Smem only needs epi(g, w, parity): the box of consumer warpgroup g's
// warp w, two per warp, kEpiBoxBytes = 16 rows x 128 bytes each.
#pragma once

#include <cuda/ptx>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/common/sm90.cuh"
#include "kernels/gemm/config.h"
#include "kernels/gemm/operands.cuh"
#include "kernels/gemm/params.h"

namespace loom::kernels::gemm {

// BM x BN tiles, consumer warpgroup g owning rows [64g, 64g + 64).
template <int BM, int BN>
struct EpilogueStage {
  static constexpr int kAcc = BN / 2;  // fp32 accumulators per consumer thread

  template <class OutT>
  __device__ static uint32_t pack2(float lo, float hi) {
    if constexpr (sizeof(OutT) == 2 && __is_same(OutT, __half)) {
      const __half2 v = __floats2half2_rn(lo, hi);
      return *reinterpret_cast<const uint32_t*>(&v);
    } else {
      const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
      return *reinterpret_cast<const uint32_t*>(&v);
    }
  }

  // Accumulator layout (m64nN, fp32): thread lane l of warp w holds, for each n8 block j,
  // rows 16w + l/4 (acc[4j], acc[4j+1]) and 16w + 8 + l/4 (acc[4j+2], acc[4j+3]) at columns
  // 8j + 2(l%4) + {0, 1}. A box is the warp's 16 rows x kCols columns (128 bytes per row); the
  // 16-byte chunk q of row r is stored at chunk q ^ (r % 8) (TMA's 128B swizzle), which keeps
  // the eight rows one store instruction touches in distinct banks.
  template <class OutT, int kCols, class Smem, class Epilogue>
  __device__ static void store(const Smem& sm, float (&acc)[kAcc], const WorkItem& item, const Epilogue& epi,
                               const GemmOperands& ops, uint32_t g, uint32_t warp, uint32_t lane, uint32_t& parity) {
    static_assert(kCols * sizeof(OutT) == 128, "a staged row is 128 bytes");
    const uint32_t row0 = item.m_block * BM + g * 64 + warp * 16;
    const uint32_t col0 = item.n_block * BN;
    if (row0 >= ops.m) return;  // all 16 rows of this warp lie past M
    const uint32_t r = lane / 4;
#pragma unroll
    for (int c = 0; c < BN / kCols; ++c) {
      if (col0 + c * kCols >= ops.n) break;  // past N (uniform across the warp)
      uint8_t* box = sm.epi(g, warp, parity);
      // The box written two chunks ago (same buffer) must have been read out by TMA.
      if (lane == 0) cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<1>{});
      __syncwarp();
      const uint32_t box_addr = sm90::smem_u32(box);
      if constexpr (sizeof(OutT) == 2) {
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          const int j = c * 8 + q;
          const uint32_t lo = pack2<OutT>(acc[4 * j], acc[4 * j + 1]);
          const uint32_t hi = pack2<OutT>(acc[4 * j + 2], acc[4 * j + 3]);
          const uint32_t off = ((static_cast<uint32_t>(q) ^ r) << 4) + (lane % 4) * 4;
          asm volatile("st.shared.b32 [%0], %1;" ::"r"(box_addr + r * 128 + off), "r"(lo) : "memory");
          asm volatile("st.shared.b32 [%0], %1;" ::"r"(box_addr + (r + 8) * 128 + off), "r"(hi) : "memory");
        }
      } else {
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const int j = c * 4 + jj;
          const uint32_t q = 2 * jj + (lane % 4) / 2;
          const uint32_t off = ((q ^ r) << 4) + (lane % 2) * 8;
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(box_addr + r * 128 + off), "f"(acc[4 * j]),
                       "f"(acc[4 * j + 1])
                       : "memory");
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(box_addr + (r + 8) * 128 + off),
                       "f"(acc[4 * j + 2]), "f"(acc[4 * j + 3])
                       : "memory");
        }
      }
      // Generic-proxy stores must be visible to the async proxy (TMA) that reads the box.
      cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
      __syncwarp();
      if (lane == 0) {
        epi.issue(box, item, row0, col0 + c * kCols);
        cuda::ptx::cp_async_bulk_commit_group();
      }
      parity ^= 1;
    }
  }
};

}  // namespace loom::kernels::gemm
