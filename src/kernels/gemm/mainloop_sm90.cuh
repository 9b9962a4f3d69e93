// The sm90 mainloop's two halves, one k-block (64 K) each: the TMA producer's loads of A and B
// into a stage of the ring, and a consumer warpgroup's wgmma over a stage. Separate from the
// compute role so that another kernel's pipeline (an attention kernel's QK^T and PV) issues its
// loads and wgmma the same way; the tile loop, the rings and the stage releases stay with the
// caller.
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/wait.cuh"
#include "kernels/common/sm90.cuh"
#include "kernels/gemm/config.h"
#include "kernels/gemm/pipeline.cuh"
#include "kernels/gemm/role_smem.cuh"

namespace loom::kernels::gemm {

// Where a k-block's A comes from: from row `row` of `map`, one box of BLOCK_M rows (row_boxes = 0)
// or row_boxes boxes of kTailRowBox rows (a tile row that ends inside the tile; `map` is then
// GemmOperands::a_rows).
struct ASource {
  const sm90::TmaDescriptor* map;
  int32_t row;
  uint32_t row_boxes = 0;
};

// The producer side, for configuration Cfg and B's layout (kBNMajor: [K, N] row-major, else
// [N, K]; kGroupedB: one such B per group, a 3-D map with the group outermost).
template <class Cfg, bool kBNMajor, bool kGroupedB = false>
struct Sm90Loads {
  static constexpr int BN = Cfg::kBlockN;
  static constexpr uint32_t kRowBoxBytes = kTailRowBox * kBlockK * 2;
  static_assert(Cfg::kBlockM % kTailRowBox == 0 && kRowBoxBytes % 1024 == 0,
                "A's row boxes must tile the stage at 1024-byte (swizzle period) steps");

  // One k-block: waits for a free stage, then issues its A and B loads (the stage's full barrier
  // expects the bytes they deliver) and moves to the next stage. False after a failed wait.
  // `group` selects B's group (kGroupedB only).
  __device__ static bool load_k_block(const RoleSmem<Cfg>& sm, PipelineState<Cfg::kStages>& stages, const ASource& a,
                                      const sm90::TmaDescriptor* b_map, int32_t n0, uint32_t kb,
                                      const WaitContext& ctx, int32_t group = 0) {
    if (!stages.wait_released(sm.empty(stages.index), ctx, sm90::BarrierWhat::kStageEmpty)) return false;
    uint64_t* full = sm.full(stages.index);
    const uint32_t a_bytes = a.row_boxes == 0 ? Cfg::kABytes : a.row_boxes * kRowBoxBytes;
    cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared, full,
                                         a_bytes + Cfg::kBBytes);
    const int32_t k0 = static_cast<int32_t>(kb * kBlockK);
    if (a.row_boxes == 0) {
      const int32_t a_coords[2] = {k0, a.row};
      cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, sm.a(stages.index), a.map,
                                      a_coords, full);
    } else {
      for (uint32_t i = 0; i < a.row_boxes; ++i) {
        const int32_t a_coords[2] = {k0, a.row + static_cast<int32_t>(i * kTailRowBox)};
        cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global,
                                        sm.a(stages.index) + i * kRowBoxBytes, a.map, a_coords, full);
      }
    }
    if constexpr (kBNMajor) {
      // [K, N] row-major: BN/64 boxes of 64 N-columns x 64 K-rows, 8 KiB apart.
#pragma unroll
      for (int i = 0; i < BN / 64; ++i) {
        load_b(b_map, sm.b(stages.index) + i * 64 * kBlockK * 2, n0 + 64 * i, k0, group, full);
      }
    } else {
      load_b(b_map, sm.b(stages.index), k0, n0, group, full);
    }
    stages.advance();
    return true;
  }

  // One box of B: (inner, outer) of a 2-D map, or of group `group` of a grouped one.
  __device__ __forceinline__ static void load_b(const sm90::TmaDescriptor* map, uint8_t* dst, int32_t inner, int32_t outer,
                                                int32_t group, uint64_t* full) {
    if constexpr (kGroupedB) {
      const int32_t coords[3] = {inner, outer, group};
      cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, dst, map, coords, full);
    } else {
      const int32_t coords[2] = {inner, outer};
      cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, dst, map, coords, full);
    }
  }
};

// The consumer side: one warpgroup's m64nBNk16 wgmma over a stage, bf16 (kBF16) or fp16; with
// kChunkN < BN, as BN / kChunkN wgmma of m64nkChunkNk16 per k16 (accumulator block c at
// acc[c * kChunkN / 2], B's rows from c * kChunkN: the same sums), for a role whose other wgmma
// write those blocks separately (swap_tail.cuh).
template <int BN, bool kBF16, bool kBNMajor, int kChunkN = BN>
struct Sm90Mma {
  static constexpr int kAcc = BN / 2;  // fp32 accumulators per consumer thread
  static_assert(BN % kChunkN == 0 && (kChunkN == BN || !kBNMajor), "chunks of N split a K-major B's rows evenly");

  // Issues and commits the 4 wgmma of one k-block: A is the warpgroup's 64 rows x 128 bytes at
  // a_smem (K-major, 128B swizzle), B the stage at b_smem (K-major: BN rows x 128 bytes; N-major:
  // BN/64 boxes of 64 K-rows, 8 KiB apart). accumulate = false starts the tile (scale-d = 0 for
  // the first wgmma). The caller waits for the group (wgmma_wait) before reusing the stage.
  __device__ static void mma_k_block(float (&acc)[kAcc], uint32_t a_smem, uint32_t b_smem, bool accumulate) {
    const uint64_t desc_a = sm90::make_smem_desc_sw128(a_smem, 16, 1024);
    const uint64_t desc_b = sm90::make_smem_desc_sw128(b_smem, kBNMajor ? 64 * kBlockK * 2 : 16, 1024);
    sm90::fence_operands(acc);
    sm90::wgmma_fence();
#pragma unroll
    for (int k = 0; k < kBlockK / 16; ++k) {
      // K-major: the next 16 columns are 32 bytes further along each 128-byte row.
      // N-major B: the next 16 K-rows are 16 * 128 bytes further.
      const uint64_t a_k = desc_a + static_cast<uint64_t>((k * 32) >> 4);
      const uint64_t b_k = desc_b + static_cast<uint64_t>(kBNMajor ? (k * 16 * 128) >> 4 : (k * 32) >> 4);
      if constexpr (kChunkN == BN) {
        sm90::wgmma_m64k16<BN, kBF16, kBNMajor ? 1 : 0>(acc, a_k, b_k, (accumulate || k > 0) ? 1u : 0u);
      } else {
#pragma unroll
        for (int c = 0; c < BN / kChunkN; ++c) {
          sm90::wgmma_m64k16<kChunkN, kBF16, 0>(*reinterpret_cast<float(*)[kChunkN / 2]>(acc + c * (kChunkN / 2)), a_k,
                                               b_k + static_cast<uint64_t>((c * kChunkN * 128) >> 4),
                                               (accumulate || k > 0) ? 1u : 0u);
        }
      }
    }
    sm90::wgmma_commit();
    sm90::fence_operands(acc);
  }
};

}  // namespace loom::kernels::gemm
