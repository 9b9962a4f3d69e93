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
  kTilePiece = 5,  // part of a split tile's K range (tail split, SchedulerParams): the epilogue
                   // stages the partial for the tile's kTileFold item, which another CTA runs
};

// The tile kinds run the mainloop and the epilogue; the others end run().
constexpr bool is_tile_kind(uint32_t kind) {
  return kind == static_cast<uint32_t>(WorkKind::kTile) || kind == static_cast<uint32_t>(WorkKind::kTileFold) ||
         kind == static_cast<uint32_t>(WorkKind::kTilePiece);
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
};
static_assert(sizeof(WorkItem) == kWorkItemBytes, "the tile and signal rings hold kWorkItemBytes per item");

// TileScheduler: which tile comes next, and whether its inputs have arrived.
//
// Order: tiles are numbered 0..m_blocks*n_blocks-1 in an L2-friendly raster (groups of group_m
// tile rows, n fastest across the group's columns), rotated so that the first tile row is
// m_block_start (a fused AllGather+GEMM starts with the rows it holds locally).
// Claim: static (compute CTA c takes c, c + C, c + 2C, ...) or, with `queue` set, from a global
// atomic counter (zeroed before the launch). Before each claim, a compute CTA whose index is
// >= *compute_limit (when set) yields: the fused kernel moves it to another role between tiles.
// Gate: with row_flags set, a tile waits (bounded) until every flag covering its A rows has
// reached `epoch`; flag f covers A rows [f * rows_per_flag, (f + 1) * rows_per_flag). Rows in
// [ungated_begin, ungated_end) need no wait (this rank's own rows).
// Rank-banded order (fused reduce operators, order_world > 1, replaces the rotation): the tile
// rows are owned by order_world ranks, order_m_blocks_per_rank each, cut into bands of
// order_band_m_blocks. The order visits band 0 of owners self+offset, self+offset+1, ...
// (mod world, `order_world` owners), then band 1 of each, and so on: with offset 1 every rank
// computes the other ranks' rows of a band before its own, so the partial tiles it owes them
// leave early and the ones it is owed have arrived when its own rows come. Requires
// m_blocks == order_world * order_m_blocks_per_rank, divisible into bands (the launcher checks).
// Fold: tiles in tile rows [fold_m_begin, fold_m_end) are handed out as WorkKind::kTileFold.
// Tail split (split_pieces >= 2; the role needs a Fold policy with piece_map()): the last
// split_tiles tiles of the order are each handed out as split_pieces items: split_pieces - 1 kTilePiece items
// (K ranges 1, 2, ... of split_pieces equal ranges), then the kTileFold item (K range 0) that
// adds the pieces' staged partials; part by part over the split tiles (every tile's first piece,
// then every tile's second, ..., then the fold items). The last partial wave of whole tiles
// leaves SMs idle for a whole tile; pieces let every SM take a share of it.
struct SchedulerParams {
  uint32_t m_rows = 0;             // M (filled by the launcher)
  uint32_t m_blocks = 0;           // ceil(M / BLOCK_M) (filled by the launcher)
  uint32_t n_blocks = 0;           // ceil(N / BLOCK_N) (filled by the launcher)
  uint32_t group_m = 8;            // raster group height in tile rows (>= 1)
  uint32_t m_block_start = 0;      // the order's first tile row
  uint32_t* queue = nullptr;       // work-queue counter (device memory, zero at launch), or null
  const uint32_t* compute_limit = nullptr;  // role-change word (device memory), or null
  const uint64_t* row_flags = nullptr;      // arrival flags (any memory the GPU can read), or null
  uint32_t rows_per_flag = 0;
  uint32_t rows_per_source = 0;    // rows each source rank contributes (error records name the rank)
  uint32_t ungated_begin = 0;
  uint32_t ungated_end = 0;
  uint64_t epoch = 0;
  uint64_t* trace = nullptr;       // optional [m_blocks * n_blocks]: %globaltimer when the tile's
                                   // loads were released (after its gate), for tests and diagnostics
  uint32_t order_world = 0;        // > 1: rank-banded order (see above); 0 or 1: rotation
  uint32_t order_self = 0;
  uint32_t order_owner_offset = 0;
  uint32_t order_m_blocks_per_rank = 0;
  uint32_t order_band_m_blocks = 0;
  uint32_t fold_m_begin = 0;       // tile rows handed out as kTileFold: [fold_m_begin, fold_m_end)
  uint32_t fold_m_end = 0;
  uint32_t k_blocks = 0;           // ceil(K / kBlockK) (filled by the launcher; split ranges)
  uint32_t split_tiles = 0;        // tail split (see above); 0: none
  uint32_t split_pieces = 0;
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
