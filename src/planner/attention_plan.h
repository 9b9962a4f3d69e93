// The attention engine's host-side decisions (host-only, no CUDA calls: linked by the CPU tests):
// argument rules, strides with defaults resolved, the tile configuration per head dim, the grid and
// the causal tile order's L2 sections.
#pragma once

#include <cstddef>
#include <cstdint>

#include "loom/attention.h"
#include "loom/status.h"

namespace loom::planner {

struct AttentionDeviceLimits {
  int sm_count = 0;
  int64_t smem_per_block_optin = 0;  // cudaDevAttrMaxSharedMemoryPerBlockOptin
  int64_t l2_bytes = 0;              // cudaDevAttrL2CacheSize
};

// The kernel configuration for a head dim, BLOCK_N and BLOCK_M (kernels/attention/config.h;
// block_n 0: the default for the head dim; block_m 0: 128); zeros when there is none.
AttentionPlanInfo attention_tile(int64_t head_dim, int block_n = 0, int block_m = 0);
// BLOCK_N the planner picks when AttentionOptions::block_n is 0.
int default_block_n(int64_t head_dim, int64_t seqlen_k, bool causal);
// BLOCK_M the planner picks when AttentionOptions::block_m is 0 (block_n: the option's).
int default_block_m(int64_t head_dim, int block_n, bool causal, int64_t seqlen_q);

// The (head dim, BLOCK_N) pairs the ring kernel is built for, at BLOCK_M 128: every default of
// default_block_n (ops/attention/flash_launch.h's kRingInstances holds one launcher per entry, in
// this order).
struct RingTile {
  int head_dim;
  int block_n;
};
inline constexpr RingTile kRingTiles[] = {{64, 128}, {64, 192}, {128, 176}, {256, 80}};
bool ring_tile_built(int64_t head_dim, int block_n);

// Element strides with the layout's defaults filled in, and the LSE's (rows are contiguous).
struct AttentionResolvedStrides {
  AttentionStrides q, k, v, out;
  int64_t lse_head = 0, lse_batch = 0;
};
AttentionResolvedStrides resolve_attention_strides(const AttentionArgs& args);

struct AttentionPlan {
  AttentionPlanInfo info;
  AttentionResolvedStrides strides;
  int64_t m_blocks = 0;       // query tiles per (batch, head)
  uint32_t section_heads = 1;  // causal order: (batch, head) pairs per L2 section
  float scale = 0.f;          // the softmax scale with the default resolved
  bool empty = false;         // nothing to compute (no query rows): launch nothing
};

// The rules of loom/attention.h (the same as attention_can_implement).
Status validate_attention(const AttentionArgs& args, const AttentionOptions& options);
Result<AttentionPlan> plan_attention(const AttentionArgs& args, const AttentionOptions& options,
                                     const AttentionDeviceLimits& device);

Status validate_attention_merge(const AttentionMergeArgs& args);

// Ring attention: the rules of loom/attention.h, and the workspace layout (byte offsets in the
// attention family's symmetric workspace; kernels/attention/sm90_ring_attention.cuh).
Status validate_ring_attention(const RingAttentionArgs& args, const RingAttentionOptions& options, int world);
struct RingWorkspace {
  uint64_t recv_k = 0, recv_v = 0, arrived = 0, bytes = 0;
  uint32_t chunks = 0;  // arrival flags per (rank, batch)
};
RingWorkspace ring_workspace(const RingAttentionArgs& args, int world);
// The engine's view of one rank's share (batched, S_l queries and keys, contiguous), and the
// engine options it runs with.
AttentionArgs ring_core_args(const RingAttentionArgs& args);
AttentionOptions ring_core_options(const RingAttentionArgs& args, const RingAttentionOptions& options);
// CTAs that push K/V first: the option, or the planner's (none for a ring of one).
int ring_kv_ctas(const RingAttentionOptions& options, int world, int sm_count);

}  // namespace loom::planner
