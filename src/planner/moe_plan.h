// The MoE operators' host-side decisions (host-only, no CUDA calls: linked by the CPU tests):
// the grouped GEMM's argument checks, workspace size, tile choice and launch plan.
#pragma once

#include <cstdint>

#include "loom/moe.h"
#include "loom/status.h"
#include "planner/gemm_heuristic.h"

namespace loom::planner {

// Rows of A and D: M_total (contiguous) or E * capacity (masked).
int64_t grouped_gemm_rows(const GroupedGemmArgs& args);

// The configuration for a grouped GEMM: the GEMM cost model (gemm_model_seconds) on the rows
// the tiles will cover. Contiguous: M_total plus half a tile row per expert (each non-empty
// expert's last tile row is on average half full); masked: every expert full (counts are unknown
// on the host).
GemmTile choose_grouped_gemm_tile(const GroupedGemmArgs& args, int sm_count, const GemmCostModel& model = {});

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

}  // namespace loom::planner
