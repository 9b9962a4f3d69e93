// loom::moe_dispatch_gemm: moe_dispatch's checks, the grouped GEMM's checks and plan over the
// receive rows, then on `stream`: the workspace's dispatch regions zeroed, the grouped GEMM's plan
// kernel (the routing's expert_offsets -> this rank's tile table), the fused kernel
// (kernels/moe/dispatch_gemm.cuh).
//
// Rules beyond moe_dispatch's and grouped_gemm_can_implement's (invalid_argument unless said):
// null weights or out; a capacity of 0 rows; weights or out not 16-byte aligned device memory of this GPU; out
// overlapping recv_x, x, the weights or the plan; a tile other than k128x256 / k128x128
// (unsupported); num_ctas, push_ctas or arrival_ctas that leave no room (planner/moe_plan.h).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "kernels/moe/dispatch_gemm.cuh"
#include "loom/moe.h"
#include "ops/gemm/gemm_launch.h"
#include "ops/launch/kernel_launch.h"
#include "ops/launch/queued_work.h"
#include "ops/moe/dispatch_gemm_launch.cuh"
#include "ops/moe/layer_launch.cuh"  // the layer's loaders
#include "ops/moe/moe_launch.h"
#include "planner/moe_plan.h"

namespace loom {

namespace {

namespace km = kernels::moe;
using namespace ops::moe;  // the launchers' shared checks (ops/moe/moe_launch.h)

Status launch_tile(GemmTile tile, const km::DispatchGemmParams& p, const ops::detail::GroupedVariant& variant, int grid,
                   cudaStream_t stream) {
  switch (tile) {
    case GemmTile::k128x256: return ops::detail::launch_sm90_moe_dispatch_gemm_128x256(p, variant, grid, stream);
    case GemmTile::k128x128: return ops::detail::launch_sm90_moe_dispatch_gemm_128x128(p, variant, grid, stream);
    default: break;
  }
  return Status::internal("moe_dispatch_gemm: planner returned a tile the fused kernel is not built for");
}

}  // namespace

namespace ops::moe {

Status load_moe_kernels() {
  return load_once_per_device([] {
    LOOM_TRY(load_moe_comm_kernels());
    LOOM_TRY(load_grouped_gemm_kernels());
    LOOM_TRY(detail::load_sm90_moe_dispatch_gemm_128x256());
    LOOM_TRY(detail::load_sm90_moe_dispatch_gemm_128x128());
    LOOM_TRY(detail::load_sm90_moe_layer_128x256());
    return detail::load_sm90_moe_layer_128x128();
  });
}

}  // namespace ops::moe

Status moe_dispatch_gemm(Communicator& comm, const MoePlan& plan, const void* x, void* recv_x, const MoeExpertGemm& gemm,
                         cudaStream_t stream, const MoeDispatchGemmOptions& options) {
  constexpr const char* kOp = "moe_dispatch_gemm";
  Communicator::Impl& impl = internal(comm);
  LOOM_ASSIGN_OR_RETURN(planner::MoeLayouts l, check_plan(impl, plan, kOp));
  LOOM_ASSIGN_OR_RETURN(const uint64_t recv_offset, check_dispatch_buffers(impl, plan, l, x, recv_x, kOp));
  LOOM_TRY_CTX(load_for_nodes(l), kOp);

  // The GEMM over the receive rows; its tile table lives in the MoE workspace (placeholder
  // address until the workspace is known: the checks only need it non-null and aligned).
  alignas(16) static char placeholder[16];
  GroupedGemmArgs args = planner::dispatch_gemm_grouped_args(plan, l, recv_x, gemm, placeholder);
  if (gemm.weights == nullptr) return Status::invalid_argument(std::string(kOp) + ": weights is null");
  if (gemm.out == nullptr) return Status::invalid_argument(std::string(kOp) + ": out is null");
  if (l.capacity == 0) {
    return Status::invalid_argument(std::string(kOp) + ": the config's capacity is 0 rows (max_tokens 0): no row to "
                                    "compute on (moe_dispatch takes it)");
  }
  LOOM_TRY_CTX(grouped_gemm_can_implement(args), kOp);
  const size_t weight_bytes = static_cast<size_t>(l.local_experts) * static_cast<size_t>(gemm.n) *
                              static_cast<size_t>(plan.config.hidden) * dtype_size(plan.config.dtype);
  const size_t out_bytes = static_cast<size_t>(l.capacity) * static_cast<size_t>(planner::grouped_gemm_out_cols(args)) *
                           dtype_size(gemm.out_dtype);
  LOOM_TRY_CTX(check_device(impl, gemm.weights, weight_bytes, 16, "weights ([E/W, N, K] or [E/W, K, N])"), kOp);
  LOOM_TRY_CTX(check_device(impl, gemm.out, out_bytes, 16, "out ([capacity, N_out])"), kOp);
  // recv_x against x and the plan: check_dispatch_buffers.
  LOOM_TRY_CTX(check_disjoint({{gemm.out, out_bytes, "out", true},
                              {recv_x, receive_bytes(l), "recv_x", true},
                              {x, token_bytes(plan, l), "x", false},
                              {gemm.weights, weight_bytes, "weights", false},
                              {plan.plan, static_cast<size_t>(l.plan.bytes), "the plan", false}}),
               kOp);
  LOOM_ASSIGN_OR_RETURN(planner::GemmDeviceLimits limits, ops::gemm_device_limits());
  limits.sm_count = impl.sm_count;
  LOOM_ASSIGN_OR_RETURN(const planner::MoeDispatchGemmPlan fused, planner::plan_moe_dispatch_gemm(args, options, limits, {l.world, l.num_nodes}));

  const km::WorkspaceLayout& wl = l.workspace;
  km::DispatchGemmParams p{};
  km::DispatchParams& d = p.dispatch;
  LOOM_TRY(prepare_launch(impl, wl, wl.dispatch_zero_begin(), wl.dispatch_zero_end(), stream, kOp, d));
  fill_dispatch(impl, plan, l, x, recv_offset, km::kDispatchGemmOp, d);
  args.workspace = static_cast<char*>(impl.heap->local_base()) + d.ws.offset + wl.tiles;
  LOOM_TRY_CTX(ops::prepare_grouped_gemm(args, fused.gemm, stream, p.gemm), kOp);
  p.gemm.sched.queue = &d.state->tile_queue;  // CTAs that join late take what is left
  p.gemm.expert_groups = options.expert_groups ? 1u : 0u;
  p.roles.set(km::DispatchGemmRole::kArrival, static_cast<uint32_t>(fused.arrival_ctas));
  p.roles.set(km::DispatchGemmRole::kForward, static_cast<uint32_t>(fused.forward_ctas));
  p.roles.set(km::DispatchGemmRole::kPush, static_cast<uint32_t>(fused.push_ctas));
  const ops::detail::GroupedVariant variant{plan.config.dtype == DType::kBF16, gemm.b_layout == BLayout::kKN,
                                            gemm.activation == GroupedActivation::kSwiGLU};
  const Status queued = launch_tile(fused.gemm.tile, p, variant, fused.grid, stream);
  if (queued.ok()) LOOM_TRY(note_staged(impl, plan));
  return ops::noted(comm, queued, stream);
}

}  // namespace loom
