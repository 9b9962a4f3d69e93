// What the attention kernel reads (plain C++, filled by the host launcher), and the tile order
// both sides agree on (host and device code: the CPU tests check that every tile is visited once).
#pragma once

#include <cstdint>

#include "kernels/common/tma_descriptor.h"
#include "runtime/device_abi.h"  // LOOM_HOST_DEVICE, WaitParams

namespace loom::kernels::attention {

// One sequence's place in the tensors: batched layouts use batch coordinate b and rows from 0;
// packed (varlen) layouts use batch coordinate 0 and rows from the sequence's offset.
struct SeqSpan {
  int32_t batch_coord;  // TMA batch coordinate
  int32_t q_row0;       // first query row of the sequence in the row dimension
  int32_t k_row0;       // first key/value row
  int32_t len_q;
  int32_t len_k;
};

struct FlashParams {
  // 4-D tensor maps {D, H, S, B} (packed layouts: {D, H, T, 1}); boxes {64, 1, rows, 1} with a
  // 128-byte swizzle: Q boxes of kBlockM rows, K and V boxes of kBlockN rows.
  sm90::TmaDescriptor q_map;
  sm90::TmaDescriptor k_map;
  sm90::TmaDescriptor v_map;

  void* out;  // [B, S, H, D] or [T, H, D] with the strides below; q's dtype, or fp32 (out_f32)
  float* lse;  // natural-log LSE [B, H, S] or [H, T] with the strides below; null: not written
  int64_t out_stride_row, out_stride_head, out_stride_batch;  // elements
  int64_t lse_stride_head, lse_stride_batch;                  // elements (rows are contiguous)

  // Packed layouts: cumulative sequence offsets [batch + 1] on the device; null when batched.
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  int32_t total_q, total_k;  // packed: rows of q and k/v (the offsets must stay inside)

  int32_t batch, heads_q, heads_kv;
  int32_t seqlen_q, seqlen_k;  // batched: the lengths; packed: the longest sequence (tiles)
  uint32_t m_blocks;           // ceil(seqlen_q / kBlockM)
  uint32_t num_tiles;          // batch * heads_q * m_blocks
  uint32_t section_heads;      // causal order: (batch, head) pairs per L2 section
  float scale_log2;            // softmax scale * log2(e)
  uint32_t causal;             // bottom-right aligned: key j is visible to query i iff j <= i + len_k - len_q
  uint32_t out_f32;            // O in fp32 (partial mode), else q's dtype

  // The launch's tile queue (tile_queue, ctas_done; kernels/comm/epoch.cuh leave_queue).
  LaunchState* queue;

  WaitParams wait;
  uint64_t epoch;
};

// Ring attention's parameters (sm90_ring_attention.cuh has the kernel and the buffer layout).
struct RingParams {
  FlashParams core;                 // q, out, lse, the local k/v maps, shapes (seqlen_q = seqlen_k = S_l), queue
  sm90::TmaDescriptor recv_k_map;   // {D, Hkv, S_l, W*B} over recv_k (batch coordinate src * B + b)
  sm90::TmaDescriptor recv_v_map;
  DeviceComm comm;
  const char* k_local;              // this rank's k and v (contiguous [B, S_l, Hkv, D])
  const char* v_local;
  uint64_t recv_k_offset, recv_v_offset, arrived_offset;  // heap offsets
  uint64_t row_bytes;               // Hkv * D * elem
  uint32_t chunks;                  // ceil(S_l / RingTunables::kChunkRows)
  uint32_t kv_ctas;
  uint32_t signature;
  uint32_t net_flag_base;           // several nodes: the network window's first per-launch word
};

// How the consumers step through a tile's key blocks (segments in order, each from its last
// block down), by what a Keys policy's segments allow: kOne, a single segment: the block index
// alone (the general cursor's segment test cost the loop 9 instructions per block, 1.3 %, in
// SASS); kEqual, segments of one length and block count that every row sees whole: the block
// index counts down and wraps to the next segment's last block (the general cursor made the
// non-causal ring kernels spill 72 bytes at hd128; a modulo per block cost the ring 4.6 % more
// instructions than the engine at W = 1, Nsight Compute, one H100); kAny, the general cursor
// (BlockCursor: per-row visible keys, any segment lengths).
enum class SegmentWalk : uint32_t { kOne, kEqual, kAny };

// A run of keys a tile attends to: rows [row0, row0 + len) of the K and V maps at batch coordinate
// batch_coord, whose first key sits at position pos0 of the sequence (causal masks compare
// positions). A tile visits its first `blocks` blocks of BLOCK_N keys (0: none); `source` is the
// rank whose keys these are when they arrive from another rank (the producer awaits them), else -1.
struct KvSegment {
  const sm90::TmaDescriptor* k_map;
  const sm90::TmaDescriptor* v_map;
  int32_t row0;
  int32_t batch_coord;
  int32_t len;
  int32_t pos0;
  int32_t source;
  int32_t blocks;
};

// What the producer hands the consumers with each Q slot (shared memory): the tile, then its
// key segments' lengths, positions and block counts (the consumers mask with these).
struct TileTask {
  static constexpr uint32_t kEnd = 0xffffffffu;  // no more tiles in this launch
  uint32_t tile;
  int32_t kv_blocks;  // every segment's blocks; 0: no visible key (O = 0, LSE = -inf)
  int32_t segments;
  uint32_t unused;
};
struct SegmentInfo {
  int32_t len, pos0, blocks, unused;
};

struct TileCoord {
  uint32_t batch, head, m_block;
};

// Tile t of the launch's order: CTAs claim tiles in this order from the launch's queue (an atomic
// counter), so a CTA that finishes early takes the next one. Non-causal: (batch, head) outermost, query blocks inside, so the
// CTAs working at one time share a head's K/V in L2 (and heads that share a K/V head under GQA
// are neighbours). Causal: (batch, head) pairs in sections of `section_heads` whose K/V fit in L2,
// and inside a section the query blocks with the most keys first (longest processing time first).
LOOM_HOST_DEVICE TileCoord tile_at(uint32_t t, uint32_t m_blocks, uint32_t heads, uint32_t pairs,
                                          bool causal, uint32_t section_heads) {
  TileCoord c{};
  uint32_t pair = 0;
  if (!causal) {
    c.m_block = t % m_blocks;
    pair = t / m_blocks;
  } else {
    const uint32_t section_tiles = section_heads * m_blocks;
    const uint32_t section = t / section_tiles;
    const uint32_t first_pair = section * section_heads;
    const uint32_t in_section = pairs - first_pair < section_heads ? pairs - first_pair : section_heads;
    const uint32_t i = t - section * section_tiles;
    c.m_block = m_blocks - 1 - i / in_section;
    pair = first_pair + i % in_section;
  }
  c.head = pair % heads;
  c.batch = pair / heads;
  return c;
}


}  // namespace loom::kernels::attention
