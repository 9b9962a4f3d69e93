// The fold policy's device side: where a fold tile's staged partials sit in the stage ring, how
// the producer loads them and how the consumers add them into their accumulators. Separate from
// the compute role because folding is opt-in (a standalone GEMM uses NoFold and compiles none
// of it) and only the fused reduce operators (kernels/tp/sm90_staged_reduce.cuh) supply a policy.
//
// Fold (fused reduce-scatter): a kTileFold item also adds partial tiles that other ranks staged
// for this tile, in rank order, into its fp32 accumulators, which the epilogue rounds once. The
// partials sit in the stage ring before the tile's last kStages k-blocks (fold_position): there
// the producer waits for them (Fold::wait_sources) and loads them (one 64-column x BLOCK_M box
// per stage, into the A buffer, 128B-swizzled like the epilogue's boxes); the consumers drain
// their wgmma, each thread adds exactly the elements its accumulators hold (conflict-free, the
// epilogue's addressing), and the remaining k-blocks accumulate on top. A Fold policy:
//   static constexpr bool kEnabled;                                  // false: NoFold
//   uint32_t world() const; uint32_t self() const;                   // ranks, this rank
//   const sm90::TmaDescriptor* map() const;   // staged partials: input element type, box {64, BLOCK_M}
//   int32_t source_row(const WorkItem& tile, uint32_t source) const; // map row of the tile's row 0
//   bool wait_sources(const WorkItem& tile, const WaitContext&) const;  // producer thread, bounded:
//                                                    // the other ranks' partials and the tile's pieces
// Tail split (tail_split.cuh): a kTilePiece item computes part of a tile's K range and stages
// its partial through the epilogue like any tile; the tile's kTileFold item (which computes K
// range 0) then also adds its item.split_count pieces, after the other ranks' partials, from
//   const sm90::TmaDescriptor* piece_map() const;    // pieces [slots * BLOCK_M, BLOCK_N], box {64, BLOCK_M}
// (a Fold policy without piece_map() folds no pieces; its scheduler must not split).
#pragma once

#include <cuda/ptx>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/comm/wait.cuh"
#include "kernels/common/sm90.cuh"
#include "kernels/gemm/operands.cuh"
#include "kernels/gemm/params.h"
#include "kernels/gemm/pipeline.cuh"
#include "kernels/gemm/role_smem.cuh"

namespace loom::kernels::gemm {

// The Fold policy of roles that fold nothing (every standalone GEMM).
struct NoFold {
  static constexpr bool kEnabled = false;
};

// The fold steps of a compute role of configuration Cfg with policy Fold.
template <class Cfg, class Fold>
struct TileFold {
  using Smem = RoleSmem<Cfg>;
  static constexpr int BM = Cfg::kBlockM;
  static constexpr int BN = Cfg::kBlockN;
  static constexpr int kStages = Cfg::kStages;
  static constexpr int kAcc = BN / 2;  // fp32 accumulators per consumer thread

  // Where a fold tile's staged partials sit in the stage ring: before its last kStages k-blocks
  // (after the last one for a short range). The producer loads them right behind the k-blocks
  // before, about kStages k-blocks ahead of the consumers, so they have landed when the
  // consumers get there. Placed after the last k-block, the fold took ~4 us per tile at 8192 x
  // 8192 x 7168, W = 2 (timeline), of ~80 us.
  __device__ static uint32_t fold_position(KRange r) {
    return r.end - r.begin > static_cast<uint32_t>(kStages) ? r.end - static_cast<uint32_t>(kStages) : r.end;
  }

  // Staged partials a fold item adds, per 64-column chunk: the other ranks', then its pieces'.
  __device__ static uint32_t pieces_of(const Fold& fold, const WorkItem& item) {
    if constexpr (requires { fold.piece_map(); }) {
      return item.split_count;
    } else {
      return 0;
    }
  }

  // At a fold tile's fold_position: waits until every other rank has staged its partial of the
  // tile (and every piece of a split tile is staged), then loads them through the stage ring in
  // the order the consumers add them: 64-column chunk by chunk; within a chunk the other ranks in
  // rank order (this rank's own accumulators are not loaded), then the pieces in slot order.
  __device__ static bool load_partials(const Smem& sm, const GemmOperands& ops, const Fold& fold, const WorkItem& item,
                                       int32_t n0, PipelineState<kStages>& stages, const WaitContext& ctx) {
    static_assert(Cfg::kABytes == BM * 64 * 2, "a staged 64-column x BLOCK_M box of 16-bit elements fills an A buffer");
    if (!fold.wait_sources(item, ctx)) return false;
    auto load_box = [&](const sm90::TmaDescriptor* map, int32_t col, int32_t row) -> bool {
      if (!stages.wait_released(sm.empty(stages.index), ctx, sm90::BarrierWhat::kStageEmpty)) return false;
      uint64_t* full = sm.full(stages.index);
      constexpr uint32_t kBoxBytes = Cfg::kABytes;  // a local copy: the PTX wrapper takes a reference
      cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared, full,
                                           kBoxBytes);
      const int32_t coords[2] = {col, row};
      cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, sm.a(stages.index), map, coords, full);
      stages.advance();
      return true;
    };
    const uint32_t world = fold.world();
    const uint32_t self = fold.self();
#pragma unroll 1
    for (int c = 0; c < BN / 64; ++c) {
      const int32_t col = n0 + 64 * c;
      if (static_cast<uint32_t>(col) >= ops.n) break;  // the consumers skip these chunks too
#pragma unroll 1
      for (uint32_t s = 0; s < world; ++s) {
        if (s != self && !load_box(fold.map(), col, fold.source_row(item, s))) return false;
      }
      if constexpr (requires { fold.piece_map(); }) {
#pragma unroll 1
        for (uint32_t i = 0; i < item.split_count; ++i) {
          if (!load_box(fold.piece_map(), 64 * c, static_cast<int32_t>((item.split_slot + i) * BM))) return false;
        }
      }
    }
    return true;
  }

  // The consumers at a fold tile's fold_position: wait for the k-block in flight (its wgmma read
  // and write the accumulators the fold adds to) and free its stage.
  __device__ __forceinline__ static void drain(const Smem& sm, float (&acc)[kAcc], uint32_t lane,
                                               uint32_t in_flight_stage) {
    sm90::wgmma_wait<0>();
    sm90::fence_operands(acc);
    if (lane == 0) cuda::ptx::mbarrier_arrive(sm.empty(in_flight_stage));
  }

  // Adds the staged partials of a fold tile into the accumulators, one 64-column chunk at a time,
  // the other sources in increasing order, then the tile's pieces in slot order:
  // acc = ((a + p_s1) + p_s2) + ... with a this rank's fp32 accumulator so far (the k-blocks of
  // its range before fold_position) and p_s the staged 16-bit partials; the remaining k-blocks
  // add to it and the epilogue rounds once. A fixed order, so
  // launch after launch gives the same bits; every element is summed by one rank (its owner).
  // Chunk c of source s sits in stage order exactly as load_partials issued it. Thread addressing
  // is the epilogue's: rows r and r + 8 of this warp's 16, the 16-byte chunk q of a 128-byte row
  // stored at q ^ (row % 8) (TMA's 128B swizzle), so one load instruction touches 32 banks.
  template <class Pair>
  __device__ static bool fold_partials(const Smem& sm, float (&acc)[kAcc], const WorkItem& item,
                                       const GemmOperands& ops, const Fold& fold, uint32_t g, uint32_t warp,
                                       uint32_t lane, PipelineState<kStages>& stages, const WaitContext& ctx) {
    const uint32_t boxes = fold.world() - 1 + pieces_of(fold, item);  // per chunk
    const uint32_t r = lane / 4;
    const uint32_t row = g * 64 + warp * 16 + r;  // this thread's first row in the BLOCK_M-row box
    const uint32_t col_bytes = (lane % 4) * 4;
    const uint32_t n0 = item.n_block * BN;
#pragma unroll
    for (int c = 0; c < BN / 64; ++c) {
      if (n0 + c * 64 >= ops.n) break;  // nothing was loaded past N (uniform over the CTA)
#pragma unroll 1
      for (uint32_t i = 0; i < boxes; ++i) {
        if (!add_staged_box<Pair>(sm, acc, c, row, r, col_bytes, lane, stages, ctx)) return false;
      }
    }
    return true;
  }

  // One staged 64-column x BLOCK_M box (chunk c of the tile) from the stage ring into the
  // accumulators, then its stage is freed. Inlined into the unrolled chunk loop: c must be a
  // constant there, or the accumulators would be indexed at run time (local memory).
  template <class Pair>
  __device__ __forceinline__ static bool add_staged_box(const Smem& sm, float (&acc)[kAcc], int c, uint32_t row,
                                                        uint32_t r, uint32_t col_bytes, uint32_t lane,
                                                        PipelineState<kStages>& stages, const WaitContext& ctx) {
    if (!stages.wait_filled(sm.full(stages.index), ctx, sm90::BarrierWhat::kStageFull)) return false;
    const uint32_t box = sm90::smem_u32(sm.a(stages.index));
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const uint32_t off = ((static_cast<uint32_t>(q) ^ r) << 4) + col_bytes;
      uint32_t lo, hi;
      asm volatile("ld.shared.b32 %0, [%1];" : "=r"(lo) : "r"(box + row * 128 + off) : "memory");
      asm volatile("ld.shared.b32 %0, [%1];" : "=r"(hi) : "r"(box + (row + 8) * 128 + off) : "memory");
      const float2 f_lo = unpack2<Pair>(lo);
      const float2 f_hi = unpack2<Pair>(hi);
      // acc[4j .. 4j+3] with j = 8c + q: (row, cols 2(l%4) + {0,1}), then (row + 8, same cols).
      float* a4 = acc + 32 * c + 4 * q;
      a4[0] += f_lo.x;
      a4[1] += f_lo.y;
      a4[2] += f_hi.x;
      a4[3] += f_hi.y;
    }
    __syncwarp();
    if (lane == 0) cuda::ptx::mbarrier_arrive(sm.empty(stages.index));
    stages.advance();
    return true;
  }

  template <class Pair>
  __device__ static float2 unpack2(uint32_t bits) {
    static_assert(sizeof(Pair) == sizeof(bits), "a pair of 16-bit elements is 4 bytes");
    const Pair v = *reinterpret_cast<const Pair*>(&bits);
    if constexpr (__is_same(Pair, __half2)) {
      return __half22float2(v);
    } else {
      return __bfloat1622float2(v);
    }
  }
};

}  // namespace loom::kernels::gemm
