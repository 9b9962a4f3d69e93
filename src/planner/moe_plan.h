// The MoE family's host-side plan (host-only, unit-tested): which configs run, the sizes of the
// plan buffer and the symmetric workspace (kernels/moe/layout.h has the formulas), each kernel's
// grid and role split, and the launch signatures ranks compare at entry.
//
// Rules (a refusal names the rule; nothing is launched):
//   unsupported       more than kMaxLocalWorld ranks per node, kMaxWorld ranks or kMaxNodes
//                     nodes; E > kMaxExperts; k > kMaxTopK; max_tokens * k or W * capacity past
//                     INT32_MAX (32-bit slot indices); several nodes whose network windows need
//                     more per-launch flags than the network flag window holds; fewer than 2 SMs
//                     (3 on several nodes)
//   invalid_argument  E, k or H not positive; E not a multiple of W; k > E; H * element size not
//                     a multiple of 16 bytes; negative max_tokens or capacity
#pragma once

#include <cstdint>
#include <initializer_list>

#include "kernels/moe/layout.h"
#include "loom/moe.h"
#include "loom/status.h"
#include "planner/gemm_heuristic.h"
#include "runtime/device_abi.h"

namespace loom::planner {

struct MoeRequest {
  MoeConfig config;
  int world = 1;      // ranks of the job, W = N * L
  int num_nodes = 1;  // nodes of the job, N (each with L = W / N ranks in one NVLink domain)
};

// A config that can run, with its buffers laid out.
struct MoeLayouts {
  int64_t capacity = 0;       // C
  int64_t local_experts = 0;  // E / W
  uint64_t row_bytes = 0;     // H * element size
  int world = 1;              // W
  int num_nodes = 1;          // N
  uint64_t net_flag_words = 0;  // per-launch words of the network flag window a call uses
  kernels::moe::PlanLayout plan{};
  kernels::moe::WorkspaceLayout workspace{};

  MoeSizes sizes() const;
};

Result<MoeLayouts> plan_moe(const MoeRequest& request);

// The dispatch kernel's grid and its arrival CTAs (the rest push): `num_ctas` CTAs (0: sm_count),
// at most sm_count (every CTA must be resident: arrival CTAs wait for rows the push CTAs of the
// same launch send), at least 2 (3 on several nodes); arrival_ctas (0: 1 / kArrivalShareDen of
// the grid, at least one) leaves at least one pushing CTA; on several nodes forward_ctas
// (1 / kForwardShareDen of the grid, at least one) take network arrivals too.
struct MoeDispatchGrid {
  int grid = 0;
  int arrival_ctas = 0;
  int forward_ctas = 0;
};
Result<MoeDispatchGrid> plan_moe_dispatch(int sm_count, int num_ctas, int arrival_ctas, int num_nodes = 1);

// The routing kernel's grid: enough CTAs for one warp per chunk of kChunkTokens tokens, at least
// one (the coordinator), at most sm_count (CTAs wait for each other within the launch).
int plan_moe_routing_grid(int64_t tokens, int sm_count);

// The combine kernel's grid: `num_ctas` (0: one warp per token up to every SM), at most sm_count
// and kMaxCtas, at least one; on several nodes (0: every SM) at least 2, of which forward_ctas
// (1 / kForwardShareDen, at least one) return the partial sums of other nodes' tokens.
struct MoeCombineGrid {
  int grid = 0;
  int forward_ctas = 0;
};
Result<MoeCombineGrid> plan_moe_combine_grid(int64_t tokens, int sm_count, int num_ctas, int num_nodes = 1);

// The 32-bit signature of a launch (entry words carry it; a rank that entered the same launch with
// another signature fails it with a mismatch, invalid_argument): ops/launch/signature.h over the op
// and the values every rank must agree on.
uint32_t moe_signature(OpId op, std::initializer_list<int64_t> values);

// ---- grouped GEMM: argument checks, workspace size, tile choice and launch plan ----
// Rows of A and D: M_total (contiguous) or E * capacity (masked).
int64_t grouped_gemm_rows(const GroupedGemmArgs& args);
// The SwiGLU epilogue stores BLOCK_N / 2 output columns per tile, whole 128-byte staged rows
// (64 16-bit values): tiles narrower than this cannot take it.
inline constexpr int kSwiGluMinBlockN = 128;
// Columns of D: N, or N / 2 with the SwiGLU epilogue.
int64_t grouped_gemm_out_cols(const GroupedGemmArgs& args);

// The configuration for a grouped GEMM: the GEMM cost model (gemm_model_seconds) on the rows
// the tiles will cover. Contiguous: M_total plus half a tile row per expert (each non-empty
// expert's last tile row is on average half full); masked: every expert full (counts are unknown
// on the host).
GemmTile choose_grouped_gemm_tile(const GroupedGemmArgs& args, int sm_count, const GemmCostModel& model = {});

// The largest raster group a grouped GEMM takes (GroupedGemmOptions::group_m; the planner's choice
// is clamped to it too).
inline constexpr int kMaxGroupedGroupM = 64;

struct GroupedGemmPlan {
  GemmTile tile = GemmTile::k128x128;
  int num_ctas = 0;
  int group_m = 1;
  int64_t rows = 0;           // rows of A and D
  int64_t max_tile_rows = 0;  // T_max for this tile's BLOCK_M (the table's used capacity)
  int64_t n_blocks = 0;
};

// Checks (grouped_gemm_can_implement), resolves kAuto, checks the tile fits the device, sizes the
// grid (the SM count, or the most tiles the counts could give when fewer).
Result<GroupedGemmPlan> plan_grouped_gemm(const GroupedGemmArgs& args, const GroupedGemmOptions& options,
                                          const GemmDeviceLimits& device);

// ---- moe_dispatch_gemm ----
// The grouped GEMM a moe_dispatch_gemm call runs: contiguous over the C receive rows of recv_x
// (offsets = the routing's expert_offsets), E/W experts, K = H; the workspace is the MoE
// workspace's tile table (its size checked against grouped_gemm_workspace_bytes).
GroupedGemmArgs dispatch_gemm_grouped_args(const MoePlan& plan, const MoeLayouts& layouts, const void* recv_x,
                                           const MoeExpertGemm& gemm, void* tile_table);

// The tiles the fused kernel is built for (kernels/moe/dispatch_gemm.cuh; two keep the build
// small): the grouped GEMM's choice, 64-row or 64-column tiles replaced by 128x128.
inline constexpr GemmTile kDispatchGemmTiles[] = {GemmTile::k128x256, GemmTile::k128x128};

struct MoeDispatchGemmPlan {
  GroupedGemmPlan gemm;  // tile, n_blocks, group_m, max_tile_rows; num_ctas == grid
  int grid = 0;
  int push_ctas = 0;     // 0 < push + arrival + forward <= grid
  int arrival_ctas = 0;
  int forward_ctas = 0;  // several nodes: network arrivals (then compute)
};
// The job a fused MoE kernel runs in: W ranks on N nodes.
struct MoeJob {
  int world = 1;
  int num_nodes = 1;
};
// Checks the GEMM (grouped_gemm_can_implement, the tile is one of kDispatchGemmTiles) and sizes the
// grid: num_ctas (0: sm_count) in [2, sm_count] (all resident: compute CTAs wait for rows the
// other roles of the launch land); push_ctas (0: grid / kFusedPushShareDen) and arrival_ctas (0:
// grid / kFusedArrivalShareDen), each at least one, together at most the grid. On one rank
// (W = 1) the pushing warps complete the receive blocks themselves: arrival_ctas 0 unless given,
// push_ctas grid / kFusedPushShareDenOneRank.
Result<MoeDispatchGemmPlan> plan_moe_dispatch_gemm(const GroupedGemmArgs& args, const MoeDispatchGemmOptions& options,
                                                   const GemmDeviceLimits& device, MoeJob job = {});

// ---- moe_layer ----
// Its two grouped GEMMs over the C receive rows, on the MoE workspace's tile table: up (recv_x ->
// hidden, K = H, N = 2I, SwiGLU) and down (hidden -> expert_out, K = I, N = H).
GroupedGemmArgs layer_up_args(const MoePlan& plan, const MoeLayouts& layouts, const MoeLayerWeights& weights,
                              const MoeLayerBuffers& buffers, void* tile_table);
GroupedGemmArgs layer_down_args(const MoePlan& plan, const MoeLayouts& layouts, const MoeLayerWeights& weights,
                                const MoeLayerBuffers& buffers, void* tile_table);

struct MoeLayerPlan {
  GroupedGemmPlan up, down;  // the same tile (hence BLOCK_M and tile table); num_ctas == grid
  int grid = 0;
  int push_ctas = 0;
  int arrival_ctas = 0;
  int forward_ctas = 0;  // several nodes: the dispatch's network arrivals (then compute)
};
// moe_dispatch_gemm's plan for up (tile, grid, roles) in `job`, then down on the same tile and
// grid.
Result<MoeLayerPlan> plan_moe_layer(const GroupedGemmArgs& up, const GroupedGemmArgs& down, const MoeLayerOptions& options,
                                    const GemmDeviceLimits& device, MoeJob job = {});

}  // namespace loom::planner
