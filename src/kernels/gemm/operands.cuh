// What a GEMM compute role computes on: the A and B operands (tensor maps and shape) and a work
// item's k-block range. Separate from compute_role.cuh because every piece of the engine
// (fold, timeline, epilogue staging) reads them, and a kernel builds GemmOperands without
// needing the role.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/common/sm90.cuh"
#include "kernels/gemm/params.h"
#include "loom/diagnostics.h"

namespace loom::kernels::gemm {

// The A and B operands as the role sees them: tensor maps (kernel parameters or global memory)
// and the problem shape.
// Grouped GEMM (a scheduler whose Tiles policy sets kGroupedB, scheduler.cuh): b is a 3-D map with
// the group outermost ([groups, K, N] or [groups, N, K], box depth 1), each tile's B loaded at its
// WorkItem::group; A's and D's rows stay absolute. Either the policy hands out each group's tile
// rows where its rows sit, each group padded to whole tile rows, or it also sets kRowRanges and
// gives every tile its first row and row limit (WorkItem::row_first, row_limit): then groups need
// no padding (a tile's loads may read the next group's rows; its stores stop at the limit).
struct GemmOperands {
  const sm90::TmaDescriptor* a;  // [M, K] row-major, box {64, BLOCK_M}, 128B swizzle
  const sm90::TmaDescriptor* b;  // N-major: [K, N], box {64, 64}; K-major: [N, K], box {64, BLOCK_N}
                                 // (grouped: one such matrix per group, see above)
  uint32_t m, n, k;
  // Optional second source of A (a fused AllGather+GEMM reads this rank's own rows where they
  // already are, not from the gathered copy; moe_layer's shared expert reads the tokens): tiles
  // whose first row r lies in [local_row_begin, local_row_end) load row r - local_row_begin of
  // a_local (same box). The range must be a multiple of BLOCK_M rows so no tile straddles it.
  const sm90::TmaDescriptor* a_local = nullptr;
  uint32_t local_row_begin = 0;
  uint32_t local_row_end = 0;
  // Optional per-tile timeline (diagnostics; loom/diagnostics.h), indexed by WorkItem::tile.
  TileTimelineRecord* timeline = nullptr;
  // A paired role's second GEMM (its own maps, shape and local row range; no timeline): the
  // operands of every kTileSecond item. Used only with a paired epilogue (paired_epilogue() below).
  const GemmOperands* second = nullptr;
  // Optional second source of B (moe_layer's shared expert: its own weights beside the routed
  // experts'): tiles of the local row range above load B from b_local (same layout and box as b;
  // a grouped GEMM's b_local has one group, loaded at group 0). a_local and b_local are
  // independent: either may be null. Read by paired roles only (paired_epilogue() below); every
  // other role ignores it, keeping its producer's registers as they were.
  const sm90::TmaDescriptor* b_local = nullptr;
  // Schedulers with row ranges: a group's last partial tile row runs swapped (swap_tail.cuh) where
  // the role's configuration allows; false: padded like the others.
  bool swap_tails = true;
  // Optional, schedulers with row ranges: the rows of `a` again with box {64, kTailRowBox}. A tile
  // whose row range ends inside it (a group's last partial tile row) then loads only
  // ceil(rows / kTailRowBox) such boxes of A instead of BLOCK_M rows. The stage's other rows keep
  // what an earlier k-block left there; they feed only accumulator rows past the range (padded
  // tiles) or columns past the swapped tile's N, which are never stored. Not used for a_local's
  // rows or by folded tiles (they read every row).
  const sm90::TmaDescriptor* a_rows = nullptr;
};

// Does epilogue policy E pair two epilogues, one per GEMM of a paired role (static constexpr bool
// kPaired = true; E::first() for kTile items, E::second() for kTileSecond items)? Such a role runs
// two GEMMs of the same tile configuration (same BLOCK_M, BLOCK_N, input type and B layout; their
// own K, N, maps and epilogue, e.g. one gated and one not) through one mainloop and one pipeline,
// which one call of the role keeps in one register allocation.
template <class E>
constexpr bool paired_epilogue() {
  return requires { requires E::kPaired; };
}

// The operands of a work item: the second GEMM's for kTileSecond items of a paired role (by value:
// a reference chosen at run time between two structs would keep both in local memory); any other
// role's own operands, by reference (its code is what it was before roles could pair).
template <bool kPaired>
__device__ __forceinline__ auto operands_of(const GemmOperands& ops, const WorkItem& item)
    -> std::conditional_t<kPaired, GemmOperands, const GemmOperands&> {
  if constexpr (kPaired) {
    if (item.kind == static_cast<uint32_t>(WorkKind::kTileSecond)) return *ops.second;
  }
  return ops;
}

// Does scheduler (or Tiles policy) S group its tiles (static constexpr bool kGroupedB = true)?
// A policy without the member does not.
template <class S>
constexpr bool groups_tiles() {
  return requires { requires S::kGroupedB; };
}

// Does scheduler (or Tiles policy) S give every tile its own row range (static constexpr bool
// kRowRanges = true; WorkItem::row_first and row_limit)? A policy without the member does not.
template <class S>
constexpr bool ranges_rows() {
  return requires { requires S::kRowRanges; };
}

// Does scheduler S gate tiles on signals of the same launch's own tiles (static constexpr bool
// kGatesOnOwnSignals = true; e.g. a paired role's second GEMM waiting for the first's rows)? Then
// a consumer must not hold a finished tile's signal while it waits for the next tile: the
// producer may be waiting at that tile's gate for exactly that signal.
template <class S>
constexpr bool gates_on_own_signals() {
  return requires { requires S::kGatesOnOwnSignals; };
}

// A tile's rows of A and D: the first, and the end of the rows its epilogue may store.
struct TileRows {
  uint32_t first, limit;
};
template <int kBlockM, bool kRowRanges>
__device__ __forceinline__ TileRows tile_rows(const WorkItem& item, uint32_t m) {
  if constexpr (kRowRanges) {
    return TileRows{item.row_first, item.row_limit};
  } else {
    return TileRows{item.m_block * kBlockM, m};
  }
}

// A tile's k-block range: [begin, end).
struct KRange {
  uint32_t begin, end;
};
__device__ __forceinline__ KRange k_range_of(const WorkItem& item, uint32_t k_blocks) {
  return KRange{item.k_begin, min(item.k_end, k_blocks)};
}

}  // namespace loom::kernels::gemm
