// The grouped GEMM's host logic without a GPU: grouped_gemm_can_implement, the workspace size
// formula, layout names and the launch plan.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/moe/grouped_gemm_params.h"
#include "loom/moe.h"
#include "planner/moe_plan.h"

namespace loom {
namespace {

// Fake, well-aligned, non-overlapping device addresses: the checks never dereference them.
const void* kA = reinterpret_cast<const void*>(uintptr_t{0x10000000});
const void* kB = reinterpret_cast<const void*>(uintptr_t{0x40000000});
void* kD = reinterpret_cast<void*>(uintptr_t{0x80000000});
void* kWorkspace = reinterpret_cast<void*>(uintptr_t{0xC0000000});
const int32_t* kOffsets = reinterpret_cast<const int32_t*>(uintptr_t{0xD0000000});

GroupedGemmArgs contiguous_args() {
  GroupedGemmArgs a;
  a.layout = GroupedLayout::kContiguous;
  a.a = kA;
  a.b = kB;
  a.d = kD;
  a.offsets = kOffsets;
  a.m_total = 1000;
  a.n = 256;
  a.k = 512;
  a.num_experts = 8;
  a.workspace = kWorkspace;
  a.workspace_bytes = grouped_gemm_workspace_bytes(a);
  return a;
}

GroupedGemmArgs masked_args() {
  GroupedGemmArgs a = contiguous_args();
  a.layout = GroupedLayout::kMasked;
  a.offsets = nullptr;
  a.counts = kOffsets;
  a.m_total = 0;
  a.capacity = 100;
  a.workspace_bytes = grouped_gemm_workspace_bytes(a);
  return a;
}

void expect_code(const GroupedGemmArgs& a, StatusCode code, const std::string& words) {
  const Status s = grouped_gemm_can_implement(a);
  EXPECT_EQ(s.code(), code) << s.to_string();
  EXPECT_NE(s.message().find(words), std::string::npos) << "message should mention '" << words << "': " << s.message();
}

TEST(GroupedGemmValidation, AcceptsBothLayouts) {
  EXPECT_TRUE(grouped_gemm_can_implement(contiguous_args()).ok()) << grouped_gemm_can_implement(contiguous_args()).to_string();
  EXPECT_TRUE(grouped_gemm_can_implement(masked_args()).ok()) << grouped_gemm_can_implement(masked_args()).to_string();
  GroupedGemmArgs a = contiguous_args();
  a.in_dtype = DType::kF16;
  a.out_dtype = DType::kF32;
  EXPECT_TRUE(grouped_gemm_can_implement(a).ok());
  a.num_experts = 1;  // one expert is a plain GEMM
  EXPECT_TRUE(grouped_gemm_can_implement(a).ok());
}

TEST(GroupedGemmValidation, BLayouts) {
  GroupedGemmArgs a = contiguous_args();
  a.b_layout = BLayout::kKN;  // [E, K, N]
  EXPECT_TRUE(grouped_gemm_can_implement(a).ok()) << grouped_gemm_can_implement(a).to_string();
  GroupedGemmArgs m = masked_args();
  m.b_layout = BLayout::kKN;
  EXPECT_TRUE(grouped_gemm_can_implement(m).ok()) << grouped_gemm_can_implement(m).to_string();
  a.b_layout = static_cast<BLayout>(5);
  expect_code(a, StatusCode::kInvalidArgument, "b_layout");
}

TEST(GroupedGemmValidation, NoRowsNeedsNoWorkspace) {
  GroupedGemmArgs a = contiguous_args();
  a.m_total = 0;
  a.workspace = nullptr;
  a.workspace_bytes = 0;
  EXPECT_TRUE(grouped_gemm_can_implement(a).ok()) << grouped_gemm_can_implement(a).to_string();
  GroupedGemmArgs m = masked_args();
  m.capacity = 0;
  m.workspace = nullptr;
  EXPECT_TRUE(grouped_gemm_can_implement(m).ok()) << grouped_gemm_can_implement(m).to_string();
}

TEST(GroupedGemmValidation, WorkspaceFollowsTheDocumentedFormula) {
  // Contiguous: 16 * (1 + ceil(M_total / 64) + E).
  EXPECT_EQ(grouped_gemm_workspace_bytes(contiguous_args()), 16u * (1 + 16 + 8));
  // Masked: 16 * (1 + E * ceil(capacity / 64)).
  EXPECT_EQ(grouped_gemm_workspace_bytes(masked_args()), 16u * (1 + 8 * 2));
  GroupedGemmArgs a = contiguous_args();
  a.num_experts = 0;
  EXPECT_EQ(grouped_gemm_workspace_bytes(a), 0u);
  // The table is laid out as the kernels read it.
  EXPECT_EQ(kernels::moe::kGroupedWorkspaceHeaderBytes, 16u);
  EXPECT_EQ(sizeof(kernels::moe::GroupedTileRow), 16u);
}

TEST(GroupedGemmValidation, NullPointersAreInvalid) {
  for (int which = 0; which < 4; ++which) {
    GroupedGemmArgs a = contiguous_args();
    if (which == 0) a.a = nullptr;
    if (which == 1) a.b = nullptr;
    if (which == 2) a.d = nullptr;
    if (which == 3) a.offsets = nullptr;
    expect_code(a, StatusCode::kInvalidArgument, which == 3 ? "offsets" : "null");
  }
  GroupedGemmArgs m = masked_args();
  m.counts = nullptr;
  expect_code(m, StatusCode::kInvalidArgument, "counts");
}

TEST(GroupedGemmValidation, ExpertsAndSizes) {
  GroupedGemmArgs a = contiguous_args();
  a.num_experts = 0;
  expect_code(a, StatusCode::kInvalidArgument, "expert");
  a = contiguous_args();
  a.num_experts = -3;
  expect_code(a, StatusCode::kInvalidArgument, "expert");
  a = contiguous_args();
  a.m_total = -1;
  expect_code(a, StatusCode::kInvalidArgument, "negative");
  GroupedGemmArgs m = masked_args();
  m.capacity = -5;
  expect_code(m, StatusCode::kInvalidArgument, "negative");
  m = masked_args();
  m.num_experts = 1 << 20;
  m.capacity = 1 << 12;  // 2^32 rows
  m.workspace_bytes = 1ull << 40;
  expect_code(m, StatusCode::kUnsupported, "E * capacity");
}

TEST(GroupedGemmValidation, NAndKMustSuitTma) {
  for (int64_t n : {0, 4, 100, 257}) {
    GroupedGemmArgs a = contiguous_args();
    a.n = n;
    expect_code(a, StatusCode::kUnsupported, "N = " + std::to_string(n));
  }
  for (int64_t k : {0, 12, 1001}) {
    GroupedGemmArgs a = contiguous_args();
    a.k = k;
    expect_code(a, StatusCode::kUnsupported, "K = " + std::to_string(k));
  }
  GroupedGemmArgs a = contiguous_args();
  a.n = -8;
  expect_code(a, StatusCode::kInvalidArgument, "negative");
}

TEST(GroupedGemmValidation, Dtypes) {
  GroupedGemmArgs a = contiguous_args();
  a.in_dtype = DType::kF32;
  expect_code(a, StatusCode::kUnsupported, "fp32");
  a = contiguous_args();
  a.out_dtype = static_cast<DType>(9);
  expect_code(a, StatusCode::kInvalidArgument, "out_dtype");
  a = contiguous_args();
  a.layout = static_cast<GroupedLayout>(7);
  expect_code(a, StatusCode::kInvalidArgument, "layout");
}

TEST(GroupedGemmValidation, Alignment) {
  GroupedGemmArgs a = contiguous_args();
  a.a = static_cast<const char*>(kA) + 8;
  expect_code(a, StatusCode::kInvalidArgument, "a is not 16-byte aligned");
  a = contiguous_args();
  a.b = static_cast<const char*>(kB) + 2;
  expect_code(a, StatusCode::kInvalidArgument, "b is not 16-byte aligned");
  a = contiguous_args();
  a.d = static_cast<char*>(kD) + 4;
  expect_code(a, StatusCode::kInvalidArgument, "d is not 16-byte aligned");
  a = contiguous_args();
  a.offsets = reinterpret_cast<const int32_t*>(reinterpret_cast<uintptr_t>(kOffsets) + 2);
  expect_code(a, StatusCode::kInvalidArgument, "offsets");
}

TEST(GroupedGemmValidation, Workspace) {
  GroupedGemmArgs a = contiguous_args();
  a.workspace = nullptr;
  expect_code(a, StatusCode::kInvalidArgument, "workspace is null");
  a = contiguous_args();
  a.workspace_bytes -= 16;
  expect_code(a, StatusCode::kInvalidArgument, "too small");
  a = contiguous_args();
  a.workspace = static_cast<char*>(kWorkspace) + 8;
  expect_code(a, StatusCode::kInvalidArgument, "workspace is not 16-byte aligned");
  a = contiguous_args();
  a.workspace = kD;
  expect_code(a, StatusCode::kInvalidArgument, "overlaps");
}

TEST(GroupedGemmValidation, OverlapsAreInvalid) {
  GroupedGemmArgs a = contiguous_args();
  a.d = const_cast<void*>(kA);
  expect_code(a, StatusCode::kInvalidArgument, "d overlaps a");
  a = contiguous_args();
  a.d = const_cast<void*>(kB);
  expect_code(a, StatusCode::kInvalidArgument, "d overlaps b");
}

TEST(GroupedGemmValidation, Options) {
  GroupedGemmOptions o;
  o.num_ctas = -1;
  EXPECT_EQ(grouped_gemm_can_implement(contiguous_args(), o).code(), StatusCode::kInvalidArgument);
  o = GroupedGemmOptions{};
  o.tile = static_cast<GemmTile>(42);
  EXPECT_EQ(grouped_gemm_can_implement(contiguous_args(), o).code(), StatusCode::kInvalidArgument);
  o = GroupedGemmOptions{};
  o.group_m = -1;
  EXPECT_EQ(grouped_gemm_can_implement(contiguous_args(), o).code(), StatusCode::kInvalidArgument);
  o.group_m = planner::kMaxGroupedGroupM + 1;
  const Status too_tall = grouped_gemm_can_implement(contiguous_args(), o);
  EXPECT_EQ(too_tall.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(too_tall.message().find("group_m"), std::string::npos) << too_tall.to_string();
  o.group_m = planner::kMaxGroupedGroupM;
  o.tile_queue = false;
  o.expert_groups = true;
  EXPECT_TRUE(grouped_gemm_can_implement(contiguous_args(), o).ok());
}

TEST(GroupedGemmValidation, LayoutNames) {
  EXPECT_EQ(grouped_layout_name(GroupedLayout::kContiguous), "contiguous");
  EXPECT_EQ(grouped_layout_name(GroupedLayout::kMasked), "masked");
  EXPECT_EQ(parse_grouped_layout("masked").value(), GroupedLayout::kMasked);
  EXPECT_EQ(parse_grouped_layout("contiguous").value(), GroupedLayout::kContiguous);
  EXPECT_EQ(parse_grouped_layout("ragged").status().code(), StatusCode::kInvalidArgument);
}

TEST(GroupedGemmValidation, SwiGLU) {
  GroupedGemmArgs a = contiguous_args();  // N = 256: 128 outputs
  a.activation = GroupedActivation::kSwiGLU;
  EXPECT_TRUE(grouped_gemm_can_implement(a).ok()) << grouped_gemm_can_implement(a).to_string();
  EXPECT_EQ(planner::grouped_gemm_out_cols(a), 128);
  a.n = 264;  // a multiple of 8, not of 16
  expect_code(a, StatusCode::kUnsupported, "multiple of 16");
  a.n = 256;
  GroupedGemmOptions narrow;
  narrow.tile = GemmTile::k128x64;
  const Status s = grouped_gemm_can_implement(a, narrow);
  EXPECT_EQ(s.code(), StatusCode::kUnsupported) << s.to_string();
  EXPECT_NE(s.message().find("BLOCK_N"), std::string::npos) << s.message();
  a.activation = static_cast<GroupedActivation>(3);
  expect_code(a, StatusCode::kInvalidArgument, "activation");
  // D holds N / 2 columns: a D right after A's last row plus N / 2 columns does not overlap.
  GroupedGemmArgs d = contiguous_args();
  d.activation = GroupedActivation::kSwiGLU;
  d.d = const_cast<char*>(static_cast<const char*>(d.a)) - 1000 * 128 * 2;  // [1000, 128] bf16 ending at A
  EXPECT_TRUE(grouped_gemm_can_implement(d).ok()) << grouped_gemm_can_implement(d).to_string();
  d.d = const_cast<char*>(static_cast<const char*>(d.a)) - 1000 * 128 * 2 + 16;
  expect_code(d, StatusCode::kInvalidArgument, "d overlaps a");
}

TEST(GroupedGemmPlan, SwiGLUNeverTakesANarrowTile) {
  // Many small experts with a short N favour narrow tiles without SwiGLU; with it the planner
  // keeps BLOCK_N >= 128 whatever the shape.
  for (int64_t n : {16, 64, 128, 256, 4096}) {
    for (int64_t rows : {64, 1000, 100000}) {
      GroupedGemmArgs a = contiguous_args();
      a.n = n;
      a.m_total = rows;
      a.num_experts = 64;
      a.activation = GroupedActivation::kSwiGLU;
      const GemmTile t = planner::choose_grouped_gemm_tile(a, 132);
      EXPECT_GE(gemm_tile_info(t).block_n, planner::kSwiGluMinBlockN) << "N " << n << ", rows " << rows;
    }
  }
}

TEST(GroupedGemmPlan, OneExpertCountsItsRowsExactly) {
  // Mixtral's fc2 at one expert per GPU (2048 x 4096 x 14336): 16 tile rows of 128 x 256 are two
  // waves on 132 SMs; an assumed half-row tail would make it 17 rows, three waves, and send the
  // choice to narrower tiles (measured 0.64x torch._grouped_mm with 64 x 128 on one H100).
  GroupedGemmArgs a = contiguous_args();
  a.num_experts = 1;
  a.m_total = 2048;
  a.n = 4096;
  a.k = 14336;
  EXPECT_EQ(planner::choose_grouped_gemm_tile(a, 132), GemmTile::k128x256);
}

TEST(GroupedGemmPlan, SizesTheTableAndTheGrid) {
  const planner::GemmDeviceLimits h200{132, 232448};
  GroupedGemmOptions o;
  o.tile = GemmTile::k128x128;
  Result<planner::GroupedGemmPlan> p = planner::plan_grouped_gemm(contiguous_args(), o, h200);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->tile, GemmTile::k128x128);
  EXPECT_EQ(p->rows, 1000);
  EXPECT_EQ(p->max_tile_rows, 8 + 8);  // ceil(1000 / 128) + E
  EXPECT_EQ(p->n_blocks, 2);
  EXPECT_EQ(p->num_ctas, 32);  // at most T_max * n_blocks tiles
  EXPECT_GE(p->group_m, 1);
  o.group_m = 3;  // the caller's raster group height replaces the planner's
  EXPECT_EQ(planner::plan_grouped_gemm(contiguous_args(), o, h200)->group_m, 3);
  o.group_m = 0;

  Result<planner::GroupedGemmPlan> m = planner::plan_grouped_gemm(masked_args(), o, h200);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->rows, 800);
  EXPECT_EQ(m->max_tile_rows, 8);  // E * ceil(100 / 128)

  // The table of any configuration fits the workspace sized for the smallest BLOCK_M.
  for (GemmTile t : {GemmTile::k128x256, GemmTile::k128x128, GemmTile::k128x64, GemmTile::k64x128}) {
    o.tile = t;
    for (const GroupedGemmArgs& a : {contiguous_args(), masked_args()}) {
      Result<planner::GroupedGemmPlan> q = planner::plan_grouped_gemm(a, o, h200);
      ASSERT_TRUE(q.ok()) << q.status().to_string();
      EXPECT_LE(16u * (1 + static_cast<uint64_t>(q->max_tile_rows)), grouped_gemm_workspace_bytes(a));
    }
  }

  GroupedGemmArgs big = contiguous_args();
  big.m_total = 32768;
  big.n = 4096;
  big.k = 7168;
  big.num_experts = 32;
  // B alone is 1.9 GB here: addresses far apart.
  big.a = reinterpret_cast<const void*>(uintptr_t{1} << 40);
  big.b = reinterpret_cast<const void*>(uintptr_t{2} << 40);
  big.d = reinterpret_cast<void*>(uintptr_t{3} << 40);
  big.workspace = reinterpret_cast<void*>(uintptr_t{4} << 40);
  big.workspace_bytes = grouped_gemm_workspace_bytes(big);
  Result<planner::GroupedGemmPlan> auto_plan = planner::plan_grouped_gemm(big, GroupedGemmOptions{}, h200);
  ASSERT_TRUE(auto_plan.ok()) << auto_plan.status().to_string();
  EXPECT_NE(auto_plan->tile, GemmTile::kAuto);
  EXPECT_EQ(auto_plan->num_ctas, 132);

  const planner::GemmDeviceLimits small_smem{132, 100 * 1024};
  o.tile = GemmTile::k128x256;
  EXPECT_EQ(planner::plan_grouped_gemm(contiguous_args(), o, small_smem).status().code(), StatusCode::kUnsupported);
}


// GroupedGemmOptions::expert_groups' order (expert_group_of as the plan kernel writes each tile
// row's word, expert_group_tile as the scheduler reads it): every position maps to a distinct
// (tile row, column block), the positions of one group cover its rows' tiles before the next
// group's, and no group holds two experts' rows or more than group_rows of them.
TEST(GroupedGemmPlan, ExpertGroupsOrderEveryTileOnceWithinOneExpert) {
  const std::vector<uint32_t> rows_per_expert = {2, 0, 1, 5, 3, 8, 1, 0, 4, 2, 9, 1};  // tile rows
  for (uint32_t group_rows : {1u, 2u, 3u, 4u, 64u}) {
    for (uint32_t n_blocks : {1u, 3u, 16u}) {
      std::vector<uint32_t> words, expert_of;
      for (uint32_t e = 0; e < rows_per_expert.size(); ++e) {
        for (uint32_t k = 0; k < rows_per_expert[e]; ++k) {
          words.push_back(kernels::moe::expert_group_of(k, rows_per_expert[e], group_rows));
          expert_of.push_back(e);
        }
      }
      const uint32_t tile_rows = static_cast<uint32_t>(words.size());
      std::vector<int> seen(static_cast<size_t>(tile_rows) * n_blocks, 0);
      uint32_t group_first = 0, group_end = 0;  // the tile rows of the group being walked
      for (uint32_t t = 0; t < tile_rows * n_blocks; ++t) {
        const uint32_t word = words[t / n_blocks];
        const kernels::moe::GroupedTile tile = kernels::moe::expert_group_tile(t, n_blocks, word);
        ASSERT_LT(tile.m_block, tile_rows) << "t " << t;
        ASSERT_LT(tile.n_block, n_blocks) << "t " << t;
        ++seen[static_cast<size_t>(tile.m_block) * n_blocks + tile.n_block];
        if (t % n_blocks == 0 && t / n_blocks >= group_end) {  // a new group starts at this row
          group_first = t / n_blocks;
          group_end = group_first + kernels::moe::expert_group_rows(word);
          EXPECT_EQ(kernels::moe::expert_group_position(word), 0u) << "t " << t;
          EXPECT_LE(group_end - group_first, group_rows);
          for (uint32_t r = group_first; r < group_end; ++r) EXPECT_EQ(expert_of[r], expert_of[group_first]);
        }
        EXPECT_GE(tile.m_block, group_first) << "t " << t << ", group_rows " << group_rows;
        EXPECT_LT(tile.m_block, group_end) << "t " << t << ", group_rows " << group_rows;
      }
      for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], 1) << "tile " << i << ", group_rows " << group_rows;
    }
  }
}

// moe_layer's queue (layer_group_word): the shared expert's S tile rows first, as one more
// expert, then the table's; every position of both GEMMs (their column blocks differ) maps to a
// distinct tile, and no group mixes shared and routed rows.
TEST(GroupedGemmPlan, LayerExpertGroupsCoverSharedAndRoutedRowsOnce) {
  const std::vector<uint32_t> rows_per_expert = {3, 0, 1, 9, 2};
  for (uint32_t shared_rows : {0u, 1u, 5u, 17u}) {
    for (uint32_t group_rows : {1u, 4u, 16u}) {
      std::vector<kernels::moe::GroupedTileRow> table;
      for (uint32_t e = 0; e < rows_per_expert.size(); ++e) {
        for (uint32_t k = 0; k < rows_per_expert[e]; ++k) {
          table.push_back({e, 0, 0, kernels::moe::expert_group_of(k, rows_per_expert[e], group_rows)});
        }
      }
      const uint32_t tile_rows = shared_rows + static_cast<uint32_t>(table.size());
      for (uint32_t n_blocks : {16u, 28u}) {  // fc1's and fc2's column blocks
        std::vector<int> seen(static_cast<size_t>(tile_rows) * n_blocks, 0);
        for (uint32_t t = 0; t < tile_rows * n_blocks; ++t) {
          const uint32_t word = kernels::moe::layer_group_word(t / n_blocks, shared_rows, group_rows, table.data());
          const kernels::moe::GroupedTile tile = kernels::moe::expert_group_tile(t, n_blocks, word);
          ASSERT_LT(tile.m_block, tile_rows) << "t " << t;
          ASSERT_LT(tile.n_block, n_blocks) << "t " << t;
          EXPECT_EQ(tile.m_block < shared_rows, t / n_blocks < shared_rows) << "t " << t << ", S " << shared_rows;
          ++seen[static_cast<size_t>(tile.m_block) * n_blocks + tile.n_block];
        }
        for (size_t i = 0; i < seen.size(); ++i) {
          EXPECT_EQ(seen[i], 1) << "tile " << i << ", S " << shared_rows << ", group_rows " << group_rows;
        }
      }
    }
  }
}

}  // namespace
}  // namespace loom
