// TileScheduler: the GEMM engine's scheduler (order, claim), configured at run time by
// SchedulerParams (kernels/gemm/params.h explains each field), with two opt-in policies:
//   Tiles  which tile row a position of the order is, whether its inputs have arrived (a bounded
//          gate) and its kind. RotatedTiles (the default): the raster rotated by m_block_start,
//          no gate, kTile. The fused tensor-parallel kernels' TpTiles (kernels/tp/tp_scheduler.cuh)
//          adds arrival gates, the rank-banded order and fold ranges; a grouped GEMM's policy
//          sets WorkItem::group.
//   Split  the tail split (kernels/gemm/tail_split.cuh); NoTailSplit by default.
//
// A scheduler is called by exactly one thread per compute CTA: the producer's elected thread.
// Interface any replacement must offer (the compute role is a template over it):
//   WorkItem next(uint32_t compute_index, uint32_t num_compute, const WaitContext& ctx);
// returning kTile (kTileFold for a tile that folds; kTilePiece / kTileFold for the pieces of a
// split tile) only once the tile's inputs may be loaded (any gate passed; a fold tile's staged
// partials are waited for by the role's Fold policy), kDone when no work is left, kYield to hand
// the CTA back to its caller between tiles, kFailed after a bounded wait failed (the failure
// already recorded by the wait).
// Tiles policy interface:
//   uint32_t m_block(uint32_t m_in_order, const SchedulerParams&) const;  // tile row at a raster row
//   bool gate(uint32_t m_block, const SchedulerParams&, const WaitContext&);  // tile row m_block's
//                                                       // inputs have arrived (bounded wait)
//   void place(WorkItem& item) const;                   // kind (kTile / kTileFold), group
//   static constexpr bool kGroupedB;                    // optional: true when place() sets groups
//                                                       // (B is then grouped, operands.cuh)
//   static constexpr bool kRowRanges;                   // optional: true when place() sets every
//                                                       // tile's row_first and row_limit
//   bool order(uint32_t t, const SchedulerParams&, uint32_t& m_block, uint32_t& n_block) const;
//                                                       // optional: places position t of the order
//                                                       // itself (true) or leaves it to the raster
#pragma once

#include <cstdint>

#include "kernels/comm/signals.cuh"
#include "kernels/comm/wait.cuh"
#include "kernels/gemm/operands.cuh"
#include "kernels/gemm/params.h"
#include "kernels/gemm/tail_split.cuh"

namespace loom::kernels::gemm {

// Raster row r of the order rotated so that it starts at tile row m_block_start.
__device__ __forceinline__ uint32_t rotated_m_block(uint32_t r, const SchedulerParams& p) {
  const uint32_t m_block = r + p.m_block_start;
  return m_block >= p.m_blocks ? m_block - p.m_blocks : m_block;
}

// The default Tiles policy: the rotated raster, nothing to wait for, every tile computed whole.
struct RotatedTiles {
  __device__ uint32_t m_block(uint32_t r, const SchedulerParams& p) const { return rotated_m_block(r, p); }
  __device__ bool gate(uint32_t /*m_block*/, const SchedulerParams& /*p*/, const WaitContext& /*ctx*/) { return true; }
  __device__ void place(WorkItem& /*item*/) const {}
};

template <class Tiles = RotatedTiles, class Split = NoTailSplit>
class TileScheduler {
 public:
  static constexpr bool kGroupedB = groups_tiles<Tiles>();
  static constexpr bool kRowRanges = ranges_rows<Tiles>();

  __device__ explicit TileScheduler(const SchedulerParams& params, Tiles tiles = Tiles{}, Split split = Split{})
      : p_(params), tiles_(tiles), split_(split) {}

  __device__ WorkItem next(uint32_t compute_index, uint32_t num_compute, const WaitContext& ctx) {
    if (p_.compute_limit != nullptr) {
      const uint32_t limit = *reinterpret_cast<const volatile uint32_t*>(p_.compute_limit);
      if (compute_index >= limit) return WorkItem{static_cast<uint32_t>(WorkKind::kYield), 0, 0, 0};
    }
    const uint32_t total = p_.m_blocks * p_.n_blocks;
    const uint32_t work = split_.items(total);
    uint32_t w;
    if (p_.queue != nullptr) {
      w = atomicAdd(p_.queue, 1u);
    } else {
      w = compute_index + claimed_ * num_compute;
      if (w < work) ++claimed_;
    }
    if (w >= work) return WorkItem{static_cast<uint32_t>(WorkKind::kDone), 0, 0, 0};

    const TailPosition pos = split_.locate(w, total);  // work item w -> position t of the order
    uint32_t m_block, n_block;
    tile_at(pos.t, m_block, n_block);
    if (!tiles_.gate(m_block, p_, ctx)) return WorkItem{static_cast<uint32_t>(WorkKind::kFailed), 0, 0, 0};
    const uint32_t tile = m_block * p_.n_blocks + n_block;
    if (p_.trace != nullptr) p_.trace[tile] = global_timer_ns();
    WorkItem item{static_cast<uint32_t>(WorkKind::kTile), m_block, n_block, tile};
    tiles_.place(item);
    split_.shape(item, pos);
    return item;
  }

  // Position t of the order -> (m_block, n_block): the Tiles policy's order where it has one, else
  // the grouped raster (groups of group_m tile rows, m fastest within a column of the group), its
  // rows mapped by the Tiles policy.
  __device__ void tile_at(uint32_t t, uint32_t& m_block, uint32_t& n_block) const {
    if constexpr (requires(uint32_t& m, uint32_t& n) { tiles_.order(t, p_, m, n); }) {
      if (tiles_.order(t, p_, m_block, n_block)) return;
    }
    const uint32_t group_m = p_.group_m == 0 ? 1u : p_.group_m;
    const uint32_t per_group = group_m * p_.n_blocks;
    const uint32_t group = t / per_group;
    const uint32_t first_m = group * group_m;
    const uint32_t rows = min(p_.m_blocks - first_m, group_m);
    const uint32_t local = t - group * per_group;
    n_block = local / rows;
    m_block = tiles_.m_block(first_m + local % rows, p_);
  }

 private:
  const SchedulerParams& p_;
  Tiles tiles_;
  Split split_;
  uint32_t claimed_ = 0;  // static claim: tiles taken so far (persists across run() calls)
};

}  // namespace loom::kernels::gemm
