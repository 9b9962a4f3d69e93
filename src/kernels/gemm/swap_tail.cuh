// Swapped tiles for a group's last partial tile row (schedulers with row ranges: a grouped
// GEMM's experts, whose row counts are rarely multiples of BM).
//
// A normal tile spends the MMA time and the loads of BM rows whatever the rows it holds, so an
// expert's last r < BM rows cost a whole tile row (about BM/2 rows of padding per expert under
// skewed routing: 1.25x the tile rows at DeepSeek-V3 fc1 with 1K tokens). Such a tile runs here
// as D^T = B A^T instead: B's BN rows (the tile's output columns) are wgmma's M, split into
// kSlices m64 blocks per consumer warpgroup, and the tile's rows are wgmma's N, rounded up to
// kStep, so the MMA time shrinks with r. The stages have a normal tile's layout (A: BM rows x 64 K,
// B: BN rows x 64 K, both K-major, 128B swizzle), but the producer fills only A's first r rows
// rounded up to kStep when the kernel passes GemmOperands::a_rows (the wgmma read no more); only
// the wgmma and the epilogue differ. The rows of A in [r, N) (the next group's, or TMA's zero
// fill) only feed accumulator columns that are never stored.
//
// Accumulators (m64nN per slice s, from acc[s * kAcc / kSlices]): thread lane l of warp w holds
// output columns c = 16w + l/4 (regs 4j, 4j+1) and c + 8 (regs 4j+2, 4j+3) of its slice, for rows
// 8j + 2(l%4) + {0, 1}. With gated pairs (B's rows interleave gate and up in groups of 8), c and
// c + 8 are a gate and its up: the thread holds whole SwiGLU pairs. The epilogue transposes
// through the warp's two staging boxes (4 KiB: rows x the warp's 16 columns, or 8 gated outputs)
// and writes 16-byte chunks with the epilogue's generic stores (write16), row by row up to r.
#pragma once

#include <cuda/ptx>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/common/sm90.cuh"
#include "kernels/gemm/config.h"
#include "kernels/gemm/epilogue_stage.cuh"
#include "kernels/gemm/operands.cuh"
#include "kernels/gemm/params.h"

namespace loom::kernels::gemm {

template <class Cfg, bool kBF16, bool kBNMajor, bool kRowRanges>
struct SwapTail {
  static constexpr int BM = Cfg::kBlockM;
  static constexpr int BN = Cfg::kBlockN;
  static constexpr int kAcc = BN / 2;
  // B's rows per consumer warpgroup, in m64 blocks.
  static constexpr int kSlices = BN / (64 * Cfg::kConsumers);
  // Swapped tiles need row ranges (a tile row that ends inside the tile), K-major B (wgmma's A
  // from shared memory is K-major here) and two consumers of 64 rows each.
  static constexpr bool kEnabled = kRowRanges && !kBNMajor && BM == 128 && Cfg::kConsumers == 2 && kSlices >= 1 &&
                                   BN % (64 * Cfg::kConsumers) == 0;
  // Each slice's accumulators are one m64 block of the normal tile's: kSliceN of its N columns.
  static constexpr int kSliceN = kSlices >= 1 ? BN / kSlices : BN;
  static constexpr int kStep = 16;  // the rows, rounded up to wgmma N steps of kStep
  static_assert(!kEnabled || kSlices * BM / 2 <= kAcc, "a swapped tile's accumulators must fit the normal tile's");
  static constexpr uint32_t kWarpStageBytes = 2 * kEpiBoxBytes;  // the warp's two staging boxes

  // The rows a tile takes swapped (0: a full tile row, taken normally).
  __device__ static uint32_t rows(const TileRows& r) {
    if constexpr (kEnabled) {
      const uint32_t n = r.limit - r.first;
      return n < static_cast<uint32_t>(BM) ? n : 0u;
    } else {
      return 0u;
    }
  }

  // Calls f(std::integral_constant<int, N>) with N = the rows rounded up to kStep (1 <= rows < BM).
  template <class F>
  __device__ static void with_n(uint32_t rows, F&& f) {
    if constexpr (kEnabled) {
      switch ((rows + kStep - 1) / kStep) {
        case 1: f(std::integral_constant<int, 16>{}); break;
        case 2: f(std::integral_constant<int, 32>{}); break;
        case 3: f(std::integral_constant<int, 48>{}); break;
        case 4: f(std::integral_constant<int, 64>{}); break;
        case 5: f(std::integral_constant<int, 80>{}); break;
        case 6: f(std::integral_constant<int, 96>{}); break;
        case 7: f(std::integral_constant<int, 112>{}); break;
        default: f(std::integral_constant<int, 128>{}); break;
      }
    }
  }
  static_assert(!kEnabled || BM == 8 * kStep, "with_n's cases cover the rows of one BM = 128 tile");

  // Slice s's accumulators start at acc[s * kAcc / kSlices] whatever N: where the normal tile's
  // wgmma block s starts (the role's Sm90Mma issues kSliceN-wide blocks).
  template <int N>
  __device__ static float (&slice(float (&acc)[kAcc], int s))[N / 2] {
    static_assert(N / 2 <= kAcc / kSlices, "a slice's accumulators stay within its share of the tile's");
    return *reinterpret_cast<float(*)[N / 2]>(acc + s * (kAcc / kSlices));
  }

  // One k-block of consumer warpgroup g: its kSlices m64 blocks of B's stage rows times the
  // first N rows of A's stage, 4 k16 steps each; commits one group (the caller waits on it).
  template <int N>
  __device__ static void mma_k_block(float (&acc)[kAcc], uint32_t a_smem, uint32_t b_smem, uint32_t g,
                                     bool accumulate) {
    const uint64_t desc_rows = sm90::make_smem_desc_sw128(a_smem, 16, 1024);
    sm90::fence_operands(acc);
    sm90::wgmma_fence();
#pragma unroll
    for (int k = 0; k < kBlockK / 16; ++k) {
#pragma unroll
      for (int s = 0; s < kSlices; ++s) {
        // B's m64 block (g * kSlices + s): 64 rows x 128 bytes, 8 KiB apart; the next 16 K
        // columns are 32 bytes further along each row, in both operands.
        const uint64_t desc_cols = sm90::make_smem_desc_sw128(b_smem + (g * kSlices + s) * 64 * 128, 16, 1024) +
                                   static_cast<uint64_t>((k * 32) >> 4);
        sm90::wgmma_m64k16<N, kBF16, 0>(slice<N>(acc, s), desc_cols, desc_rows + static_cast<uint64_t>((k * 32) >> 4),
                                       (accumulate || k > 0) ? 1u : 0u);
      }
    }
    sm90::wgmma_commit();
    sm90::fence_operands(acc);
  }

  // The tile's first `rows` rows to the epilogue's destination, in its output type.
  template <int N, class E>
  __device__ static void store(const RoleSmem<Cfg>& sm, float (&acc)[kAcc], const WorkItem& item, const E& e,
                               const GemmOperands& o, uint32_t g, uint32_t warp, uint32_t lane, uint32_t rows) {
    const uint32_t out = e.out_dtype();
    if (out == 2u) {
      store_as<N, float>(sm, acc, item, e, o, g, warp, lane, rows);
    } else if (out == 1u) {
      store_as<N, __half>(sm, acc, item, e, o, g, warp, lane, rows);
    } else {
      store_as<N, __nv_bfloat16>(sm, acc, item, e, o, g, warp, lane, rows);
    }
  }

 private:
  template <class OutT>
  __device__ static void put(uint8_t* p, float v) {
    if constexpr (std::is_same_v<OutT, float>) {
      *reinterpret_cast<float*>(p) = v;
    } else if constexpr (std::is_same_v<OutT, __half>) {
      *reinterpret_cast<__half*>(p) = __float2half_rn(v);
    } else {
      *reinterpret_cast<__nv_bfloat16*>(p) = __float2bfloat16_rn(v);
    }
  }

  template <int N, class OutT, class E>
  __device__ static void store_as(const RoleSmem<Cfg>& sm, float (&acc)[kAcc], const WorkItem& item, const E& e,
                                  const GemmOperands& o, uint32_t g, uint32_t warp, uint32_t lane, uint32_t rows) {
    constexpr bool kGated = gated_pairs<E>();
    constexpr uint32_t kCols = kGated ? 8 : 16;  // the warp's output columns per slice
    constexpr uint32_t kRowBytes = kCols * sizeof(OutT);
    constexpr uint32_t kChunks = kRowBytes / 16;  // 16-byte chunks per staged row
    constexpr int kPassRows = static_cast<int>(kWarpStageBytes / kRowBytes);  // rows one staging pass holds
    static_assert(kPassRows % 8 == 0, "a staging pass holds whole n8 blocks of rows");
    uint8_t* const stage = sm.epi(g, warp, 0);  // both boxes of the warp, contiguous
    const uint32_t n_out = kGated ? o.n / 2 : o.n;
    const uint32_t c = lane / 4, pair = 2 * (lane % 4);
    // Earlier tiles' TMA stores read these boxes: they must be done before they are rewritten.
    if (lane == 0) cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<0>{});
    __syncwarp();
#pragma unroll
    for (int s = 0; s < kSlices; ++s) {
      const float(&a)[N / 2] = slice<N>(acc, s);
      const uint32_t first_col = (g * kSlices + s) * 64 + 16 * warp;  // within the tile's BN
      const uint32_t col0 = kGated ? item.n_block * (BN / 2) + first_col / 2 : item.n_block * BN + first_col;
#pragma unroll
      for (int pass = 0; pass < (N + kPassRows - 1) / kPassRows; ++pass) {
        const uint32_t row_base = pass * kPassRows;
        // No early exit from these loops: every accumulator index must stay a constant (a loop
        // left early is not unrolled, and the accumulators would move to local memory).
        if (row_base >= rows) continue;  // uniform across the warp
#pragma unroll
        for (int jj = 0; jj < kPassRows / 8; ++jj) {
          const int j = pass * kPassRows / 8 + jj;
          if (j >= N / 8) continue;
          uint8_t* r0 = stage + (8 * jj + pair) * kRowBytes;
          if constexpr (kGated) {
            put<OutT>(r0 + c * sizeof(OutT), swiglu(a[4 * j], a[4 * j + 2]));
            put<OutT>(r0 + kRowBytes + c * sizeof(OutT), swiglu(a[4 * j + 1], a[4 * j + 3]));
          } else {
            put<OutT>(r0 + c * sizeof(OutT), a[4 * j]);
            put<OutT>(r0 + kRowBytes + c * sizeof(OutT), a[4 * j + 1]);
            put<OutT>(r0 + (c + 8) * sizeof(OutT), a[4 * j + 2]);
            put<OutT>(r0 + kRowBytes + (c + 8) * sizeof(OutT), a[4 * j + 3]);
          }
        }
        __syncwarp();
        const uint32_t pass_rows = min(rows - row_base, static_cast<uint32_t>(kPassRows));
        for (uint32_t i = lane; i < pass_rows * kChunks; i += 32) {
          const uint32_t r = i / kChunks, q = i % kChunks;
          const uint32_t col = col0 + q * (16 / sizeof(OutT));
          if (col < n_out) {
            const uint4 v = *reinterpret_cast<const uint4*>(stage + r * kRowBytes + q * 16);
            e.write16(item.row_first + row_base + r, col, v);
          }
        }
        __syncwarp();  // every lane's reads are done before the next pass rewrites the boxes
      }
    }
  }
};

}  // namespace loom::kernels::gemm
