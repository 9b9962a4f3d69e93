// loom::gemm and the GEMM engine's launcher: validate -> plan -> tensor maps -> launch.
#include <cuda_runtime_api.h>

#include <string>

#include "kernels/gemm/sm90_gemm.cuh"
#include "loom/gemm.h"
#include "ops/gemm/gemm_dispatch.cuh"
#include "ops/gemm/gemm_launch.h"
#include "ops/launch/checks.h"
#include "ops/launch/standalone_wait.h"
#include "planner/gemm_heuristic.h"
#include "runtime/cuda_check.h"

namespace loom::ops {

namespace kg = kernels::gemm;

Result<planner::GemmDeviceLimits> gemm_device_limits() {
  LOOM_ASSIGN_OR_RETURN(const HopperDevice device, current_hopper_device("gemm", "the GEMM engine"));
  return planner::GemmDeviceLimits{device.sm_count, device.smem_per_block_optin};
}

namespace {

Status check_launch_fields(const GemmLaunch& l, const planner::GemmPlan& plan) {
  const GemmTileInfo info = gemm_tile_info(plan.tile);
  const kg::EpilogueParams& e = l.epi;
  const kg::SchedulerParams& s = l.sched;
  if (e.num_dst < 1 || e.num_dst > static_cast<uint32_t>(kg::kMaxDst)) {
    return Status::invalid_argument("gemm launch: epi.num_dst must be 1..8");
  }
  if (e.op > static_cast<uint32_t>(kg::EpilogueOp::kReduceAdd)) return Status::invalid_argument("gemm launch: bad epi.op");
  if (e.num_dst > 1) {
    if (e.rows_per_dst == 0 || e.rows_per_dst % kg::kEpiRows != 0) {
      return Status::invalid_argument("gemm launch: with num_dst > 1, rows_per_dst must be a positive multiple of " +
                                      std::to_string(kg::kEpiRows) + " (the epilogue's box height)");
    }
    if (static_cast<int64_t>(e.rows_per_dst) * (e.num_dst - 1) >= l.args.m) {
      return Status::invalid_argument("gemm launch: every destination must receive rows (rows_per_dst * (num_dst - 1) < M)");
    }
    for (uint32_t d = 0; d < e.num_dst; ++d) {
      if (l.dst[d] == nullptr && !(d == 0 && l.args.d != nullptr)) {
        return Status::invalid_argument("gemm launch: dst[" + std::to_string(d) + "] is null");
      }
      if (reinterpret_cast<uintptr_t>(l.dst[d]) % 16 != 0) {
        return Status::invalid_argument("gemm launch: dst[" + std::to_string(d) + "] is not 16-byte aligned");
      }
    }
  }
  const bool signals = e.flags[0] != nullptr;
  if (signals) {
    for (uint32_t d = 0; d < e.num_dst; ++d) {
      if (e.flags[d] == nullptr) return Status::invalid_argument("gemm launch: signalling needs flags for every destination");
    }
    if (e.chunk_m_blocks > 0 && e.chunk_counters == nullptr) {
      return Status::invalid_argument("gemm launch: per-chunk signals need chunk_counters");
    }
    if (e.num_dst > 1) {
      const uint64_t unit = static_cast<uint64_t>(info.block_m) * (e.chunk_m_blocks > 0 ? e.chunk_m_blocks : 1);
      if (e.rows_per_dst % unit != 0) {
        return Status::invalid_argument("gemm launch: with signals, rows_per_dst must be a multiple of BLOCK_M" +
                                        std::string(e.chunk_m_blocks > 0 ? " * chunk_m_blocks" : "") + " (" +
                                        std::to_string(unit) + ")");
      }
    }
  }
  if (s.m_block_start >= static_cast<uint64_t>(std::max<int64_t>(plan.m_blocks, 1))) {
    return Status::invalid_argument("gemm launch: m_block_start must be < m_blocks");
  }
  if (l.wait.device_abort == nullptr) return Status::invalid_argument("gemm launch: wait.device_abort is null");
  return Status{};
}

}  // namespace

Result<GemmLaunchPlan> plan_gemm_launch(const GemmArgs& args, const GemmOptions& options) {
  LOOM_TRY(gemm_can_implement(args, options));
  LOOM_ASSIGN_OR_RETURN(planner::GemmDeviceLimits limits, gemm_device_limits());
  LOOM_ASSIGN_OR_RETURN(planner::GemmPlan plan, planner::plan_gemm(args, options, limits));
  return GemmLaunchPlan{plan.tile, plan.num_ctas, plan.group_m, plan.m_blocks, plan.n_blocks};
}

Status gemm_kernel_params(const GemmLaunch& l, kg::GemmKernelParams* params, GemmLaunchPlan* launch_plan) {
  LOOM_TRY(gemm_can_implement(l.args, l.options));
  if (l.args.m == 0) return Status::invalid_argument("gemm launch: M = 0 has no kernel parameters");
  LOOM_ASSIGN_OR_RETURN(planner::GemmDeviceLimits limits, gemm_device_limits());
  LOOM_ASSIGN_OR_RETURN(planner::GemmPlan plan, planner::plan_gemm(l.args, l.options, limits));
  LOOM_TRY(check_launch_fields(l, plan));
  *launch_plan = GemmLaunchPlan{plan.tile, plan.num_ctas, plan.group_m, plan.m_blocks, plan.n_blocks};

  kg::GemmKernelParams& p = *params;
  p = kg::GemmKernelParams{};
  LOOM_TRY(encode_gemm_operand_maps(l.args, plan.tile, &p.a, &p.b));
  const planner::GemmLeadingDims ld = planner::resolve_leading_dims(l.args);
  const uint32_t num_dst = l.epi.num_dst;
  for (uint32_t d = 0; d < num_dst; ++d) {
    void* ptr = l.dst[d] != nullptr ? l.dst[d] : l.args.d;
    int64_t rows = l.args.m;
    if (num_dst > 1) {
      rows = d + 1 < num_dst ? static_cast<int64_t>(l.epi.rows_per_dst)
                             : l.args.m - static_cast<int64_t>(l.epi.rows_per_dst) * (num_dst - 1);
    }
    LOOM_TRY(encode_gemm_output_map(ptr, rows, l.args.n, ld.ldd, l.args.out_dtype, &p.dst[d]));
  }
  p.m = static_cast<uint32_t>(l.args.m);
  p.n = static_cast<uint32_t>(l.args.n);
  p.k = static_cast<uint32_t>(l.args.k);
  p.sched = l.sched;
  p.sched.m_rows = p.m;
  p.sched.m_blocks = static_cast<uint32_t>(plan.m_blocks);
  p.sched.n_blocks = static_cast<uint32_t>(plan.n_blocks);
  p.sched.group_m = static_cast<uint32_t>(plan.group_m);
  p.epi = l.epi;
  p.epi.out_dtype = static_cast<uint32_t>(l.args.out_dtype);
  p.wait = l.wait;
  p.timeline = l.options.timeline;
  return Status{};
}

Status launch_gemm(const GemmLaunch& l, cudaStream_t stream) {
  LOOM_TRY(gemm_can_implement(l.args, l.options));
  if (l.args.m == 0) return Status{};
  kg::GemmKernelParams p;
  GemmLaunchPlan plan;
  LOOM_TRY(gemm_kernel_params(l, &p, &plan));
  const bool bf16 = l.args.in_dtype == DType::kBF16;
  const bool n_major = l.args.b_layout == BLayout::kKN;
  switch (plan.tile) {
    case GemmTile::k128x256: return detail::launch_sm90_gemm_128x256(p, bf16, n_major, plan.num_ctas, stream);
    case GemmTile::k128x128: return detail::launch_sm90_gemm_128x128(p, bf16, n_major, plan.num_ctas, stream);
    case GemmTile::k128x64: return detail::launch_sm90_gemm_128x64(p, bf16, n_major, plan.num_ctas, stream);
    case GemmTile::k64x128: return detail::launch_sm90_gemm_64x128(p, bf16, n_major, plan.num_ctas, stream);
    case GemmTile::kAuto: break;
  }
  return Status::internal("gemm: planner returned no tile");
}

}  // namespace loom::ops

namespace loom {

Result<GemmPlanInfo> gemm_plan(const GemmArgs& args, const GemmOptions& options) {
  LOOM_ASSIGN_OR_RETURN(const ops::GemmLaunchPlan plan, ops::plan_gemm_launch(args, options));
  return GemmPlanInfo{plan.tile, gemm_tile_info(plan.tile), plan.num_ctas, plan.group_m, plan.m_blocks * plan.n_blocks};
}

Status gemm(const GemmArgs& args, cudaStream_t stream, const GemmOptions& options) {
  LOOM_TRY(gemm_can_implement(args, options));
  if (args.m == 0) return Status{};
  LOOM_ASSIGN_OR_RETURN(ops::StandaloneWait * w, ops::standalone_wait());
  LOOM_TRY(ops::take_standalone_error(*w, stream));
  ops::GemmLaunch l;
  l.args = args;
  l.options = options;
  l.wait = w->params();
  return ops::launch_gemm(l, stream);
}

}  // namespace loom
