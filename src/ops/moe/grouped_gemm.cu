// loom::grouped_gemm: check -> plan -> tensor maps -> the plan kernel and the GEMM kernel, in
// stream order (kernels/moe/grouped_gemm.cuh explains both).
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/moe/grouped_gemm.cuh"
#include "kernels/moe/grouped_gemm_params.h"
#include "loom/moe.h"
#include "ops/gemm/gemm_launch.h"
#include "ops/launch/kernel_launch.h"
#include "ops/launch/standalone_wait.h"
#include "ops/moe/grouped_gemm_dispatch.cuh"
#include "planner/moe_plan.h"

namespace loom {

namespace {

namespace kg = kernels::gemm;
namespace km = kernels::moe;

static_assert(planner::kMaxGroupedGroupM <= static_cast<int>(km::kMaxExpertGroupRows),
              "a raster group's tile rows must fit the tile table's 8-bit expert-group fields");

Status launch_tile(GemmTile tile, const km::GroupedGemmKernelParams& p, const ops::detail::GroupedVariant& variant,
                   int grid, cudaStream_t stream) {
  switch (tile) {
    case GemmTile::k128x256: return ops::detail::launch_sm90_grouped_gemm_128x256(p, variant, grid, stream);
    case GemmTile::k128x128: return ops::detail::launch_sm90_grouped_gemm_128x128(p, variant, grid, stream);
    case GemmTile::k128x64: return ops::detail::launch_sm90_grouped_gemm_128x64(p, variant, grid, stream);
    case GemmTile::k64x128: return ops::detail::launch_sm90_grouped_gemm_64x128(p, variant, grid, stream);
    case GemmTile::kAuto: break;
  }
  return Status::internal("grouped_gemm: planner returned no tile");
}

}  // namespace

namespace ops {

Status encode_grouped_gemm(const GroupedGemmArgs& args, const planner::GroupedGemmPlan& plan,
                           kernels::moe::GroupedGemmKernelParams& p) {
  const int64_t rows = planner::grouped_gemm_rows(args);
  const GemmTileInfo info = gemm_tile_info(plan.tile);

  LOOM_TRY(ops::encode_gemm_rows_map(args.a, rows, args.k, args.k, args.in_dtype, info.block_m, &p.a));
  LOOM_TRY(ops::encode_gemm_rows_map(args.a, rows, args.k, args.k, args.in_dtype, kg::kTailRowBox, &p.a_rows));
  GemmArgs b_args;  // one expert's B, as the engine's B encoder reads it
  b_args.b = args.b;
  b_args.m = rows;
  b_args.n = args.n;
  b_args.k = args.k;
  b_args.in_dtype = args.in_dtype;
  b_args.b_layout = args.b_layout;
  LOOM_TRY(ops::encode_gemm_grouped_b_map(b_args, args.num_experts, plan.tile, &p.b));
  const int64_t out_cols = planner::grouped_gemm_out_cols(args);
  LOOM_TRY(ops::encode_gemm_output_map(args.d, rows, out_cols, out_cols, args.out_dtype, &p.d));
  p.m = static_cast<uint32_t>(rows);
  p.n = static_cast<uint32_t>(args.n);
  p.k = static_cast<uint32_t>(args.k);
  p.sched = kg::SchedulerParams{};
  p.sched.m_rows = p.m;
  p.sched.m_blocks = 0;  // the kernel reads the tile rows from the workspace
  p.sched.n_blocks = static_cast<uint32_t>(plan.n_blocks);
  p.sched.group_m = static_cast<uint32_t>(plan.group_m);
  p.epi = kg::EpilogueParams{};
  p.epi.op = static_cast<uint32_t>(kg::EpilogueOp::kStore);
  p.epi.out_dtype = static_cast<uint32_t>(args.out_dtype);
  p.epi.num_dst = 1;
  auto* header = static_cast<km::GroupedWorkspaceHeader*>(args.workspace);
  auto* table = reinterpret_cast<km::GroupedTileRow*>(static_cast<uint8_t*>(args.workspace) + km::kGroupedWorkspaceHeaderBytes);
  p.header = header;
  p.table = table;
  p.d_ptr = static_cast<uint8_t*>(args.d);
  p.ldd_bytes = static_cast<uint64_t>(out_cols) * dtype_size(args.out_dtype);
  return {};
}

Status prepare_grouped_gemm(const GroupedGemmArgs& args, const planner::GroupedGemmPlan& plan, cudaStream_t stream,
                            kernels::moe::GroupedGemmKernelParams& p) {
  LOOM_TRY(encode_grouped_gemm(args, plan, p));
  const bool masked = args.layout == GroupedLayout::kMasked;
  const GemmTileInfo info = gemm_tile_info(plan.tile);
  km::GroupedPlanParams plan_params;
  plan_params.layout = static_cast<uint32_t>(masked ? km::GroupedRows::kMasked : km::GroupedRows::kContiguous);
  plan_params.experts = static_cast<uint32_t>(args.num_experts);
  plan_params.rows = static_cast<uint32_t>(masked ? args.capacity : args.m_total);
  plan_params.block_m = static_cast<uint32_t>(info.block_m);
  plan_params.offsets = args.offsets;
  plan_params.counts = args.counts;
  plan_params.header = static_cast<km::GroupedWorkspaceHeader*>(args.workspace);
  plan_params.table =
      reinterpret_cast<km::GroupedTileRow*>(static_cast<uint8_t*>(args.workspace) + km::kGroupedWorkspaceHeaderBytes);
  plan_params.max_tile_rows = static_cast<uint32_t>(plan.max_tile_rows);
  plan_params.group_rows = static_cast<uint32_t>(plan.group_m);

  constexpr int kPlanThreads = km::GroupedGemmTunables::kPlanThreads;
  return ops::launch_kernel(&km::grouped_gemm_plan_kernel<kPlanThreads>, 1u, kPlanThreads, 0, stream, plan_params);
}

Status load_grouped_gemm_kernels() {
  constexpr int kPlanThreads = km::GroupedGemmTunables::kPlanThreads;
  LOOM_TRY(prepare_kernel(reinterpret_cast<const void*>(&km::grouped_gemm_plan_kernel<kPlanThreads>), 0));
  LOOM_TRY(detail::load_sm90_grouped_gemm_128x256());
  LOOM_TRY(detail::load_sm90_grouped_gemm_128x128());
  LOOM_TRY(detail::load_sm90_grouped_gemm_128x64());
  return detail::load_sm90_grouped_gemm_64x128();
}

}  // namespace ops

Result<GroupedGemmPlanInfo> grouped_gemm_plan(const GroupedGemmArgs& args, const GroupedGemmOptions& options) {
  LOOM_TRY(grouped_gemm_can_implement(args, options));
  LOOM_ASSIGN_OR_RETURN(planner::GemmDeviceLimits limits, ops::gemm_device_limits());
  LOOM_ASSIGN_OR_RETURN(planner::GroupedGemmPlan plan, planner::plan_grouped_gemm(args, options, limits));
  return GroupedGemmPlanInfo{plan.tile, gemm_tile_info(plan.tile), plan.num_ctas, plan.rows,
                             plan.max_tile_rows * plan.n_blocks, grouped_gemm_workspace_bytes(args)};
}

Status grouped_gemm(const GroupedGemmArgs& args, cudaStream_t stream, const GroupedGemmOptions& options) {
  LOOM_TRY(grouped_gemm_can_implement(args, options));
  const int64_t rows = planner::grouped_gemm_rows(args);
  if (rows == 0) return Status{};  // no row of D to write (M_total or capacity is 0)
  LOOM_ASSIGN_OR_RETURN(planner::GemmDeviceLimits limits, ops::gemm_device_limits());
  LOOM_ASSIGN_OR_RETURN(planner::GroupedGemmPlan plan, planner::plan_grouped_gemm(args, options, limits));
  LOOM_ASSIGN_OR_RETURN(ops::StandaloneWait * wait, ops::standalone_wait());
  LOOM_TRY(ops::take_standalone_error(*wait, stream));
  km::GroupedGemmKernelParams p{};
  LOOM_TRY(ops::prepare_grouped_gemm(args, plan, stream, p));
  p.wait = wait->params();
  p.swap_tails = options.swap_tails ? 1u : 0u;
  p.tile_queue = options.tile_queue ? 1u : 0u;
  p.expert_groups = options.expert_groups ? 1u : 0u;
  const ops::detail::GroupedVariant variant{args.in_dtype == DType::kBF16, args.b_layout == BLayout::kKN,
                                            args.activation == GroupedActivation::kSwiGLU};
  return launch_tile(plan.tile, p, variant, plan.num_ctas, stream);
}

}  // namespace loom
