// Plain data of the grouped GEMM (a MoE layer's experts, kernels/moe/grouped_gemm.cuh) shared by
// the host launcher, the planner and the kernels: the tunables, the two row layouts and the
// workspace. No CUDA headers (the planner and the CPU tests include it).
//
// Workspace (device memory the caller provides; the plan kernel rewrites it at every launch, the
// GEMM kernel reads it):
//   header   16 bytes        GroupedWorkspaceHeader: tile_rows (T, the tile rows of all experts
//                            together), clamped_experts (experts whose offsets or count were out
//                            of range and were clamped, see loom/moe.h), tile_queue (the claim
//                            counter of GroupedGemmOptions::tile_queue)
//   table    T_max x 16 B    GroupedTileRow per tile row, experts in order, each expert's rows in
//                            ceil(count_e / BLOCK_M) tile rows
//   T_max = ceil(M_total / kMinBlockM) + E          (contiguous: each expert wastes < 1 tile row)
//         = E * ceil(capacity / kMinBlockM)          (masked)
//   bytes = 16 + 16 * T_max   (grouped_gemm_workspace_bytes, loom/moe.h)
// kMinBlockM (the smallest BLOCK_M) bounds T for every tile configuration, so the size does not
// depend on the configuration the planner picks.
#pragma once

#include <cstdint>

#include "runtime/device_abi.h"

namespace loom::kernels::moe {

struct GroupedGemmTunables {
  // The plan kernel: one CTA of kPlanThreads threads scans the experts' tile-row counts
  // kPlanThreads experts at a time (one warp-shuffle scan per warp, one over the warps' sums).
  static constexpr int kPlanThreads = 1024;
  // The smallest BLOCK_M of a GEMM engine configuration (kernels/gemm/config.h): sizes the table.
  static constexpr int kMinBlockM = 64;
};
static_assert(GroupedGemmTunables::kPlanThreads % 32 == 0 && GroupedGemmTunables::kPlanThreads / 32 <= 32,
              "the plan kernel's scan over the warps' sums runs in one warp: at most 32 warps");

// Where each expert's rows of A and D are.
enum class GroupedRows : uint32_t {
  kContiguous = 0,  // A [M_total, K], D [M_total, N]; expert e's rows [offsets[e], offsets[e+1])
  kMasked = 1,      // A [E, capacity, K], D [E, capacity, N]; expert e's rows e * capacity + [0, counts[e])
};

struct GroupedWorkspaceHeader {
  uint32_t tile_rows;        // T
  uint32_t clamped_experts;  // experts whose offsets or count were clamped (malformed input)
  uint32_t tile_queue;       // tiles claimed so far (GroupedGemmOptions::tile_queue): zeroed by the
                             // plan kernel, counted up by the GEMM kernel's schedulers
  uint32_t unused;
};
static_assert(sizeof(GroupedWorkspaceHeader) == 16, "the table starts 16 bytes into the workspace");

// One tile row: BLOCK_M rows of expert `expert` from row_first (a row of A and D), storable up to
// row_limit (the expert's end; exclusive). `group`: the row's expert group (an expert's tile rows,
// cut into groups of at most GroupedPlanParams::group_rows; GroupedGemmOptions::expert_groups):
// bits 0-7 the row's position in its group, bits 8-15 the group's tile rows.
struct alignas(16) GroupedTileRow {
  uint32_t expert;
  uint32_t row_first;
  uint32_t row_limit;
  uint32_t group;
};
inline constexpr uint32_t kMaxExpertGroupRows = 255;  // what `group`'s 8-bit fields hold

LOOM_HOST_DEVICE constexpr uint32_t expert_group_word(uint32_t position, uint32_t rows) {
  return position | rows << 8;
}
LOOM_HOST_DEVICE constexpr uint32_t expert_group_position(uint32_t word) { return word & 0xffu; }
LOOM_HOST_DEVICE constexpr uint32_t expert_group_rows(uint32_t word) { return (word >> 8) & 0xffu; }

// The group word of an expert's k-th tile row, of expert_rows, in groups of at most group_rows.
LOOM_HOST_DEVICE constexpr uint32_t expert_group_of(uint32_t k, uint32_t expert_rows, uint32_t group_rows) {
  const uint32_t first = k / group_rows * group_rows;
  const uint32_t rest = expert_rows - first;
  return expert_group_word(k - first, rest < group_rows ? rest : group_rows);
}

// Position t of the expert-group order -> (tile row, column block), given the group word of tile
// row t / n_blocks: the groups are runs of consecutive tile rows walked one after another, R x
// n_blocks positions for a group of R rows, column-major within it (its rows share each B tile).
struct GroupedTile {
  uint32_t m_block, n_block;
};
LOOM_HOST_DEVICE constexpr GroupedTile expert_group_tile(uint32_t t, uint32_t n_blocks, uint32_t word) {
  const uint32_t rows = expert_group_rows(word);
  const uint32_t first = t / n_blocks - expert_group_position(word);
  const uint32_t local = t - first * n_blocks;
  return GroupedTile{first + local % rows, local / rows};
}
static_assert(sizeof(GroupedTileRow) == 16, "a tile row is read with one 16-byte load");

// The group word of virtual tile row r of moe_layer's queue (kernels/moe/layer.cuh): the shared
// expert's S tile rows first, as one more expert cut into groups of at most group_rows, then the
// tile table's rows with the words the plan kernel wrote.
LOOM_HOST_DEVICE constexpr uint32_t layer_group_word(uint32_t r, uint32_t shared_rows, uint32_t group_rows,
                                                     const GroupedTileRow* table) {
  return r < shared_rows ? expert_group_of(r, shared_rows, group_rows) : table[r - shared_rows].group;
}

constexpr uint64_t kGroupedWorkspaceHeaderBytes = sizeof(GroupedWorkspaceHeader);

// T_max for a BLOCK_M of block_m (see above).
constexpr uint64_t grouped_max_tile_rows(GroupedRows layout, uint64_t rows, uint64_t experts, uint64_t block_m) {
  return layout == GroupedRows::kContiguous ? (rows + block_m - 1) / block_m + experts
                                            : experts * ((rows + block_m - 1) / block_m);
}

// What the plan kernel reads and writes.
struct GroupedPlanParams {
  uint32_t layout = 0;       // GroupedRows
  uint32_t experts = 0;      // E >= 1
  uint32_t rows = 0;         // contiguous: M_total; masked: capacity
  uint32_t block_m = 0;      // the GEMM's BLOCK_M
  const int32_t* offsets = nullptr;  // contiguous: [E + 1]
  const int32_t* counts = nullptr;   // masked: [E]
  GroupedWorkspaceHeader* header = nullptr;
  GroupedTileRow* table = nullptr;
  uint32_t max_tile_rows = 0;  // the table's capacity (entries)
  uint32_t group_rows = 1;     // the most tile rows of one expert group (1 .. kMaxExpertGroupRows)
};

}  // namespace loom::kernels::moe
