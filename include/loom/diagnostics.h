// Diagnostics that a caller opts into per launch. Plain data, no CUDA types.
#pragma once

#include <cstdint>

namespace loom {

// Where one output tile's time went (GemmOptions::timeline, TpGemmOptions::timeline,
// `loom-bench ... --timeline DIR`). The caller passes device memory for
// tile_timeline_capacity(M, N) records; the record of output tile (m_block, n_block) is at index
// m_block * n_blocks + n_block (n_blocks = ceil(N / BLOCK_N) of the tile that ran), and the K
// pieces of split tiles (fused gemm_rs / gemm_ar tail split, kind 5) follow at index
// m_blocks * n_blocks + piece slot while that is within tile_timeline_capacity(M, N) (a piece's
// record does not name its tile); the kernel
// overwrites the record of every tile it computes and leaves the others alone. _ns fields are
// %globaltimer nanoseconds (one time base for all SMs of a GPU, updated about every
// microsecond); _clock fields are the computing SM's %clock64 (cycle-exact, comparable only
// within one SM), so (stored_clock - claimed_clock) / (stored_ns - claimed_ns) is the SM clock in
// GHz over the tile.
struct TileTimelineRecord {
  uint64_t claimed_ns;      // the producer got the tile from the scheduler (its input gate passed)
  uint64_t stored_ns;       // the epilogue handed its last box to TMA
  uint64_t claimed_clock;   // %clock64 at claimed_ns
  uint64_t mainloop_clock;  // the consumers' last tensor-core instruction of the tile retired
  uint64_t stored_clock;    // %clock64 at stored_ns
  uint32_t fold_cycles;     // cycles the consumers spent folding other ranks' partials in (in the
                            // mainloop: waiting for them, adding them); 0 for a plain tile
  uint32_t cta;             // blockIdx.x of the computing CTA
  uint32_t smid;            // the SM it ran on
  uint32_t kind;            // 0: plain tile, 4: tile that folded partials in, 5: K piece of a split tile
  uint32_t fold_drain_cycles;   // of fold_cycles: draining the tensor cores' last k-block
  uint32_t fold_signal_cycles;  // of fold_cycles: posting the previous tile's signal
};
static_assert(sizeof(TileTimelineRecord) == 64, "a timeline record is one 64-byte line");

// Records that are always enough for an M x N output, whatever tile the launch picks (the finest
// tile grid any configuration has: 64 x 64). Size a timeline buffer with it: the kernel indexes
// the tiles' records by its own tile grid (and the pieces' after them, within this capacity).
constexpr int64_t tile_timeline_capacity(int64_t m, int64_t n) { return ((m + 63) / 64) * ((n + 63) / 64); }

// Where one CTA's time went in one moe_layer launch (MoeLayerOptions::phases). The caller passes
// device memory for at least as many records as the GPU has SMs (the layer's grid never has more
// CTAs); moe_layer zeroes the grid's records on its stream, and CTA i then fills record i. _ns
// fields are %globaltimer nanoseconds (one time base for the GPU's SMs, updated about every
// microsecond); _wait_ns fields sum, over the CTA's claims, the time a claimed tile waited for its
// inputs (an fc1 tile for its receive blocks, an fc2 tile for its fc1 tile row).
struct MoeLayerPhaseRecord {
  uint64_t entered_ns;     // the launch's entry handshake passed
  uint64_t roles_done_ns;  // its dispatch role (arrival, forward, push) finished; compute CTAs: at once
  uint64_t first_tile_ns;  // its first tile claimed with its inputs ready (0: it computed none)
  uint64_t tiles_done_ns;  // the task queue ran dry for it (its compute role returned)
  uint64_t reduced_ns;     // its share of the combine done (0: none ran, e.g. a failed routing)
  uint64_t up_wait_ns;     // fc1 claims waiting for their receive blocks, summed
  uint64_t down_wait_ns;   // fc2 claims waiting for their fc1 tile rows, summed
  uint32_t role;           // the CTA's first role: 0 arrival, 1 forward, 2 push, 3 compute only
  uint32_t tiles;          // tiles it computed, both GEMMs (the shared expert's included)
};
static_assert(sizeof(MoeLayerPhaseRecord) == 64, "a phase record is one 64-byte line");

}  // namespace loom
