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

// Does an epilogue policy store gated pairs (kGatedPairs = true: SwiGLU over interleaved columns,
// below)? A policy without the member does not.
template <class E>
constexpr bool gated_pairs() {
  return requires { requires E::kGatedPairs; };
}

// SwiGLU of a gate and an up value in fp32: silu(gate) * up.
__device__ __forceinline__ float swiglu(float gate, float up) { return __fdividef(gate, 1.f + __expf(-gate)) * up; }

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
  //
  // Gated pairs (Epilogue::kGatedPairs): B's rows (N) interleave gate and up in groups of 8 (n8
  // block 2j: gate columns 8j..8j+7, block 2j+1: the up columns of the same outputs), so each
  // thread holds both halves of its outputs and the tile stores BN / 2 columns, silu(gate) * up;
  // D has N / 2 columns.
  //
  // kRowRanges (tiles with their own row range, operands.cuh): the tile starts at item.row_first
  // and only rows below item.row_limit are written. A warp whose 16 rows cross the limit (a
  // group's last rows; the rows after it belong to the next group) stages its boxes as usual and
  // then writes their first rows itself (Epilogue::write16, generic stores) instead of handing
  // them to TMA, whose only row bound is the tensor map's.
  template <class OutT, int kCols, bool kRowRanges = false, class Smem, class Epilogue>
  __device__ static void store(const Smem& sm, float (&acc)[kAcc], const WorkItem& item, const Epilogue& epi,
                               const GemmOperands& ops, uint32_t g, uint32_t warp, uint32_t lane, uint32_t& parity) {
    static_assert(kCols * sizeof(OutT) == 128, "a staged row is 128 bytes");
    constexpr bool kGated = gated_pairs<Epilogue>();
    constexpr int kOutCols = kGated ? BN / 2 : BN;  // output columns of a tile
    static_assert(kOutCols % kCols == 0, "a tile's output columns fill whole staged boxes");
    const TileRows rows = tile_rows<BM, kRowRanges>(item, ops.m);
    const uint32_t row0 = rows.first + g * 64 + warp * 16;
    const uint32_t col0 = item.n_block * kOutCols;
    const uint32_t n_out = kGated ? ops.n / 2 : ops.n;
    if (row0 >= rows.limit) return;  // all 16 rows of this warp lie past the limit (M)
    const uint32_t box_rows = kRowRanges ? min(rows.limit - row0, static_cast<uint32_t>(kEpiRows)) : kEpiRows;
    const bool direct = kRowRanges && box_rows < static_cast<uint32_t>(kEpiRows);  // uniform across the warp
    const uint32_t r = lane / 4;
#pragma unroll
    for (int c = 0; c < kOutCols / kCols; ++c) {
      if (col0 + c * kCols >= n_out) break;  // past N (uniform across the warp)
      uint8_t* box = sm.epi(g, warp, parity);
      // The box written two chunks ago (same buffer) must have been read out by TMA; a box written
      // directly waits for every earlier one (the chunk before it may not have gone to TMA).
      if (lane == 0) {
        if (direct) {
          cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<0>{});
        } else {
          cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<1>{});
        }
      }
      __syncwarp();
      const uint32_t box_addr = sm90::smem_u32(box);
      if constexpr (sizeof(OutT) == 2) {
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          const int j = c * 8 + q;
          uint32_t lo, hi;
          if constexpr (kGated) {
            const float* gate = acc + 8 * j;  // n8 block 2j, its up values in block 2j + 1
            lo = pack2<OutT>(swiglu(gate[0], gate[4]), swiglu(gate[1], gate[5]));
            hi = pack2<OutT>(swiglu(gate[2], gate[6]), swiglu(gate[3], gate[7]));
          } else {
            lo = pack2<OutT>(acc[4 * j], acc[4 * j + 1]);
            hi = pack2<OutT>(acc[4 * j + 2], acc[4 * j + 3]);
          }
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
          float v[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) v[i] = kGated ? swiglu(acc[8 * j + i], acc[8 * j + 4 + i]) : acc[4 * j + i];
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(box_addr + r * 128 + off), "f"(v[0]), "f"(v[1])
                       : "memory");
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(box_addr + (r + 8) * 128 + off), "f"(v[2]), "f"(v[3])
                       : "memory");
        }
      }
      if constexpr (kRowRanges) {
        if (direct) {
          __syncwarp();
          write_rows<OutT, kCols>(box, epi, n_out, row0, box_rows, col0 + c * kCols, lane);
          __syncwarp();  // every lane's reads of the box are done before it is written again
          parity ^= 1;
          continue;
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

  // The first `rows` rows of a staged box (row r's 16-byte chunk q at chunk q ^ (r % 8)) to
  // rows row0.. and columns col.. of the destination, 16 bytes per lane and store, chunks past the
  // output's n_out columns left out (a multiple of 8, so a chunk is wholly inside or outside).
  template <class OutT, int kCols, class Epilogue>
  __device__ static void write_rows(const uint8_t* box, const Epilogue& epi, uint32_t n_out, uint32_t row0,
                                    uint32_t rows, uint32_t col, uint32_t lane) {
    constexpr uint32_t kChunkCols = 16 / sizeof(OutT);
    for (uint32_t i = lane; i < rows * 8; i += 32) {
      const uint32_t row = i / 8, q = i % 8;
      const uint32_t chunk_col = col + q * kChunkCols;
      if (chunk_col >= n_out) continue;
      const uint4 v = *reinterpret_cast<const uint4*>(box + row * 128 + ((q ^ (row % 8)) << 4));
      epi.write16(row0 + row, chunk_col, v);
    }
  }
};

}  // namespace loom::kernels::gemm
