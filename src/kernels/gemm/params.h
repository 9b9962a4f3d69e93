// Plain data shared by the GEMM engine's host launchers and its device code: what a scheduler
// and an epilogue are told at launch. No CUDA headers (the planner and CPU tests include it).
#pragma once

#include <cstdint>

#include "kernels/gemm/config.h"

namespace loom::kernels::gemm {

// What the producer hands the consumers through the tile ring.
enum class WorkKind : uint32_t {
  kTile = 0,      // compute tile (m_block, n_block)
  kDone = 1,      // no more tiles: leave
  kYield = 2,     // leave the compute role for now (role change); the caller may call run() again
  kFailed = 3,    // a bounded wait failed (already recorded): leave
  kTileFold = 4,  // compute tile whose accumulators also receive partial tiles staged by other
                  // ranks (the role's Fold policy) before the epilogue: fused reduce-scatter
  kTilePiece = 5,  // part of a split tile's K range (the tail split, tail_split.cuh): the epilogue
                   // stages the partial for the tile's kTileFold item, which another CTA runs
  kTileSecond = 6,  // compute tile of a paired role's second GEMM (GemmOperands::second, a paired
                    // epilogue: operands.cuh): two GEMMs through one role, e.g. a whole MoE FFN
};

// The tile kinds run the mainloop and the epilogue; the others end run().
constexpr bool is_tile_kind(uint32_t kind) {
  return kind == static_cast<uint32_t>(WorkKind::kTile) || kind == static_cast<uint32_t>(WorkKind::kTileFold) ||
         kind == static_cast<uint32_t>(WorkKind::kTilePiece);
}
// A role's tile kinds: a paired role's include kTileSecond (a separate test, so that every other
// role's code stays what it was).
template <bool kPaired>
constexpr bool is_tile_kind_of(uint32_t kind) {
  return is_tile_kind(kind) || (kPaired && kind == static_cast<uint32_t>(WorkKind::kTileSecond));
}

struct WorkItem {
  uint32_t kind;     // WorkKind
  uint32_t m_block;
  uint32_t n_block;
  uint32_t tile;     // m_block * n_blocks + n_block
  // k-blocks [k_begin, min(k_end, k_blocks)) of the tile: all of K unless the tile is split.
  uint32_t k_begin = 0;
  uint32_t k_end = ~0u;
  // Split tiles: a kTilePiece stages its partial in piece slot `split_slot`; the tile's kTileFold
  // item adds the `split_count` pieces in slots [split_slot, split_slot + split_count) after the
  // other ranks' partials. 0 / 0 for a whole tile.
  uint32_t split_slot = 0;
  uint32_t split_count = 0;
  // Grouped GEMM (a MoE layer's experts): the group whose B the tile multiplies, set by a
  // scheduler policy that groups tiles (scheduler.cuh, kGroupedB); 0 for every other GEMM.
  uint32_t group = 0;
  // Row ranges (a Tiles policy with kRowRanges, scheduler.cuh): the tile's first row of A and D
  // (any row, not only a multiple of BLOCK_M: a group's rows start where the previous group's
  // end) and the end of the rows it may store (exclusive; rows past it belong to another group
  // or to nobody). Every other scheduler leaves both 0 and its tiles start at m_block * BLOCK_M,
  // stored up to M.
  uint32_t row_first = 0;
  uint32_t row_limit = 0;
};
static_assert(sizeof(WorkItem) == kWorkItemBytes, "the tile and signal rings hold kWorkItemBytes per item");

// TileScheduler (scheduler.cuh): which tile comes next.
//
// Order: tiles are numbered 0..m_blocks*n_blocks-1 in an L2-friendly raster (groups of group_m
// tile rows, n fastest across the group's columns), rotated so that the first tile row is
// m_block_start (a fused AllGather+GEMM starts with the rows it holds locally); a Tiles policy
// may map the raster's rows otherwise (kernels/tp/tp_scheduler.cuh: the rank-banded order).
// Claim: static (compute CTA c takes c, c + C, c + 2C, ...) or, with `queue` set, from a global
// atomic counter (zeroed before the launch). Before each claim, a compute CTA whose index is
// >= *compute_limit (when set) yields: the fused kernel moves it to another role between tiles.
struct SchedulerParams {
  uint32_t m_rows = 0;             // M (filled by the launcher)
  uint32_t m_blocks = 0;           // ceil(M / BLOCK_M) (filled by the launcher)
  uint32_t n_blocks = 0;           // ceil(N / BLOCK_N) (filled by the launcher)
  uint32_t group_m = 8;            // raster group height in tile rows (>= 1)
  uint32_t m_block_start = 0;      // the order's first tile row
  uint32_t* queue = nullptr;       // work-queue counter (device memory, zero at launch), or null
  const uint32_t* compute_limit = nullptr;  // role-change word (device memory), or null
  uint64_t epoch = 0;              // the launch's epoch (error records; what a policy's gates wait for)
  uint64_t* trace = nullptr;       // optional [m_blocks * n_blocks]: %globaltimer when the tile's
                                   // loads were released (after its gate), for tests and diagnostics
};

// The tail split (tail_split.cuh), an opt-in policy: the last `tiles` tiles of the order are each
// handed out as `pieces` K ranges of the tile's k_blocks. pieces < 2: no split.
struct TailSplitParams {
  uint32_t k_blocks = 0;  // ceil(K / kBlockK) (filled by the launcher)
  uint32_t tiles = 0;
  uint32_t pieces = 0;
};

enum class EpilogueOp : uint32_t {
  kStore = 0,      // TMA store: D = acc
  kReduceAdd = 1,  // TMA reduce-add (cp.reduce.async.bulk.tensor .add): D += acc
};

// TileEpilogue: where a finished tile goes and whom it tells.
//
// Destinations: num_dst tensor maps (the launcher encodes one per destination pointer, which may
// be a peer GPU's memory mapped over NVLink). Output row r goes to destination r / rows_per_dst
// at local row r % rows_per_dst (num_dst == 1: everything to destination 0).
// Signal: with flags[d] set, once a tile's data is visible at system scope the epilogue stores
// `epoch` (release, system scope) into flags[d][flag_offset + i]: i = the tile's index local to
// its destination (chunk_m_blocks == 0), or, with chunk_m_blocks = c > 0, the index of its band
// of c tile rows (a chunk) local to its destination, once every tile of the chunk is visible
// (counted in chunk_counters, which hold epoch * tiles_per_chunk after each launch).
struct EpilogueParams {
  uint32_t op = 0;                 // EpilogueOp
  uint32_t out_dtype = 0;          // loom::DType (kBF16 = 0, kF16 = 1, kF32 = 2)
  uint32_t num_dst = 1;
  uint32_t rows_per_dst = 0;
  uint64_t* flags[kMaxDst] = {};
  uint32_t flag_offset = 0;
  uint32_t chunk_m_blocks = 0;
  uint64_t* chunk_counters = nullptr;
  uint64_t epoch = 0;
};

}  // namespace loom::kernels::gemm
