// Host launchers of the MoE family: moe_routing, moe_dispatch, moe_combine (validate -> plan ->
// workspace -> launch; kernels in kernels/moe/), the size queries and moe_report.
//
// Rules beyond the config's (planner/moe_plan.h), checked before anything is launched or written
// (invalid_argument): a failed communicator (aborted); num_tokens outside [0, max_tokens];
// topk_ids / topk_weights / expert_offsets not 4-byte aligned device memory of this GPU (ids only
// when T > 0); the plan not 16-byte aligned device memory; x / out not 16-byte aligned device
// memory; recv_x / expert_out not inside one symmetric allocation of [C, H] (16-byte aligned);
// an output overlapping an input; a MoePlan whose capacity differs from its config's.
//
// Each call zeroes, on `stream` just before its kernel, the workspace regions its kernel waits on
// (kernels/moe/layout.h): peers write into them only after this rank's entry word of the launch.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/moe/combine.cuh"
#include "kernels/moe/dispatch_kernel.cuh"
#include "kernels/moe/routing.cuh"
#include "loom/moe.h"
#include "ops/launch/family_resources.h"
#include "ops/launch/kernel_launch.h"
#include "ops/launch/queued_work.h"
#include "ops/moe/moe_launch.h"
#include "planner/moe_plan.h"
#include "runtime/communicator_impl.h"
#include "runtime/cuda_check.h"

namespace loom {
namespace {

namespace km = kernels::moe;
using km::MoeTunables;
using namespace ops::moe;  // the launchers' shared checks (ops/moe/moe_launch.h)

}  // namespace

namespace ops::moe {

Status load_moe_comm_kernels() {
  LOOM_TRY(prepare_kernel(reinterpret_cast<const void*>(&km::moe_routing_kernel), 0));
  LOOM_TRY(prepare_kernel(reinterpret_cast<const void*>(&km::moe_dispatch_kernel), 0));
  LOOM_TRY(prepare_kernel(reinterpret_cast<const void*>(&km::moe_combine_kernel<__nv_bfloat16>), 0));
  LOOM_TRY(prepare_kernel(reinterpret_cast<const void*>(&km::moe_combine_kernel<__half>), 0));
  return prepare_kernel(reinterpret_cast<const void*>(&km::moe_combine_kernel<float>), 0);
}

}  // namespace ops::moe

Status moe_can_implement(const Communicator& comm, const MoeConfig& config) {
  return layouts_for(internal(comm), config).status();
}

Result<MoeSizes> moe_sizes(const Communicator& comm, const MoeConfig& config) {
  LOOM_ASSIGN_OR_RETURN(planner::MoeLayouts l, layouts_for(internal(comm), config));
  return l.sizes();
}

Status moe_reserve_workspace(Communicator& comm, const MoeConfig& config, cudaStream_t stream) {
  Communicator::Impl& impl = internal(comm);
  LOOM_TRY(impl.check_usable());
  LOOM_ASSIGN_OR_RETURN(planner::MoeLayouts l, layouts_for(impl, config));
  return ops::family_workspace(impl, kFamily, static_cast<size_t>(l.workspace.bytes), stream, "moe_reserve_workspace")
      .status();
}

Result<MoePlan> moe_routing(Communicator& comm, const MoeConfig& config, const MoeRoutingArgs& args, cudaStream_t stream) {
  constexpr const char* kOp = "moe_routing";
  Communicator::Impl& impl = internal(comm);
  LOOM_TRY(impl.check_usable());
  Result<planner::MoeLayouts> planned = layouts_for(impl, config);
  if (!planned.ok()) return std::move(planned).take_status().with_context(kOp);
  const planner::MoeLayouts& l = *planned;
  LOOM_TRY_CTX(load_for_nodes(l), kOp);
  const int64_t t = args.num_tokens;
  if (t < 0 || t > config.max_tokens) {
    return Status::invalid_argument(std::string(kOp) + ": num_tokens " + num(t) + " is outside [0, max_tokens = " +
                                    num(config.max_tokens) + "]");
  }
  const size_t pair_bytes = static_cast<size_t>(t) * static_cast<size_t>(config.top_k) * 4;
  const size_t offsets_bytes = static_cast<size_t>(l.local_experts + 1) * 4;
  if (t > 0 && args.topk_ids == nullptr) return Status::invalid_argument(std::string(kOp) + ": topk_ids is null");
  LOOM_TRY_CTX(check_device(impl, args.topk_ids, pair_bytes, 4, "topk_ids ([T, k] int32)"), kOp);
  if (args.topk_weights != nullptr) {
    LOOM_TRY_CTX(check_device(impl, args.topk_weights, pair_bytes, 4, "topk_weights ([T, k] fp32)"), kOp);
  }
  if (args.plan == nullptr) return Status::invalid_argument(std::string(kOp) + ": plan is null");
  if (args.expert_offsets == nullptr) return Status::invalid_argument(std::string(kOp) + ": expert_offsets is null");
  LOOM_TRY_CTX(check_device(impl, args.plan, static_cast<size_t>(l.plan.bytes), 16, "plan (moe_sizes().plan_bytes)"), kOp);
  LOOM_TRY_CTX(check_device(impl, args.expert_offsets, offsets_bytes, 4, "expert_offsets ([E/W + 1] int32)"), kOp);
  LOOM_TRY_CTX(check_disjoint({{args.plan, static_cast<size_t>(l.plan.bytes), "plan", true},
                              {args.expert_offsets, offsets_bytes, "expert_offsets", true},
                              {args.topk_ids, pair_bytes, "topk_ids", false},
                              {args.topk_weights, args.topk_weights ? pair_bytes : 0, "topk_weights", false}}),
               kOp);

  const km::WorkspaceLayout& wl = l.workspace;
  km::RoutingParams p{};
  LOOM_TRY(prepare_launch(impl, wl, wl.routing_zero_begin(), wl.routing_zero_end(), stream, kOp, p));
  char* plan = static_cast<char*>(args.plan);
  p.ids = args.topk_ids;
  p.weights = args.topk_weights;
  p.expert_offsets = args.expert_offsets;
  p.status = reinterpret_cast<km::MoeStatusWords*>(plan + l.plan.status);
  p.slot_dest = reinterpret_cast<int32_t*>(plan + l.plan.slot_dest);
  p.slot_weight = reinterpret_cast<float*>(plan + l.plan.slot_weight);
  p.chunk_counts = reinterpret_cast<int32_t*>(plan + l.plan.chunk_counts);
  p.send_base = reinterpret_cast<int32_t*>(plan + l.plan.send_base);
  p.token_nodes = l.num_nodes > 1 ? reinterpret_cast<uint64_t*>(plan + l.plan.token_nodes) : nullptr;
  p.num_tokens = static_cast<uint32_t>(t);
  p.top_k = static_cast<uint32_t>(config.top_k);
  p.num_experts = static_cast<uint32_t>(config.num_experts);
  p.local_experts = static_cast<uint32_t>(l.local_experts);
  p.capacity = static_cast<uint32_t>(l.capacity);
  p.drop = config.overflow == MoeOverflow::kDrop ? 1u : 0u;
  p.net_flag_base = net_flag_base(impl);
  // The workspace's heap offset is part of the plan: peers write into it by their own offset.
  p.signature = planner::moe_signature(km::kRoutingOp, {config.num_experts, config.top_k, l.capacity, p.drop,
                                                        config.max_tokens, job_shape(impl), static_cast<int64_t>(p.ws.offset)});
  p.roles.set(km::RoutingRole::kCoordinator, 1);
  const int grid = planner::plan_moe_routing_grid(t, impl.sm_count);
  const Status queued = ops::launch_kernel(&km::moe_routing_kernel, static_cast<unsigned>(grid), MoeTunables::kThreads,
                                           km::routing_smem_bytes(p.num_experts), stream, p);
  LOOM_TRY(ops::noted(comm, queued, stream));
  LOOM_ASSIGN_OR_RETURN(Communicator::Impl::OperatorFamily * family, impl.family(kFamily));
  return MoePlan{config, l.capacity, t, args.plan, args.expert_offsets, ++family->handles};
}

Status moe_dispatch(Communicator& comm, const MoePlan& plan, const void* x, void* recv_x, cudaStream_t stream,
                    const MoeDispatchOptions& options) {
  constexpr const char* kOp = "moe_dispatch";
  Communicator::Impl& impl = internal(comm);
  LOOM_ASSIGN_OR_RETURN(planner::MoeLayouts l, check_plan(impl, plan, kOp));
  LOOM_ASSIGN_OR_RETURN(const uint64_t recv_offset, check_dispatch_buffers(impl, plan, l, x, recv_x, kOp));
  LOOM_TRY_CTX(load_for_nodes(l), kOp);
  Result<planner::MoeDispatchGrid> grid =
      planner::plan_moe_dispatch(impl.sm_count, options.num_ctas, options.arrival_ctas, l.num_nodes);
  if (!grid.ok()) return std::move(grid).take_status();

  const km::WorkspaceLayout& wl = l.workspace;
  km::DispatchParams p{};
  LOOM_TRY(prepare_launch(impl, wl, wl.dispatch_zero_begin(), wl.dispatch_zero_end(), stream, kOp, p));
  fill_dispatch(impl, plan, l, x, recv_offset, km::kDispatchOp, p);
  p.roles.set(km::DispatchRole::kArrival, static_cast<uint32_t>(grid->arrival_ctas));
  p.roles.set(km::DispatchRole::kForward, static_cast<uint32_t>(grid->forward_ctas));
  const Status queued = ops::launch_kernel(&km::moe_dispatch_kernel, static_cast<unsigned>(grid->grid), MoeTunables::kThreads,
                                           0, stream, p);
  if (queued.ok()) LOOM_TRY(note_staged(impl, plan));
  return ops::noted(comm, queued, stream);
}

Status moe_combine(Communicator& comm, const MoePlan& plan, const MoeCombineArgs& args, cudaStream_t stream,
                   const MoeCombineOptions& options) {
  constexpr const char* kOp = "moe_combine";
  Communicator::Impl& impl = internal(comm);
  LOOM_ASSIGN_OR_RETURN(planner::MoeLayouts l, check_plan(impl, plan, kOp));
  const int64_t hidden = args.hidden != 0 ? args.hidden : plan.config.hidden;
  if (hidden <= 0) return Status::invalid_argument(std::string(kOp) + ": hidden must be positive, not " + num(hidden));
  if (l.num_nodes > 1 && hidden > plan.config.hidden) {
    return Status::unsupported(std::string(kOp) + ": hidden " + num(hidden) + " is wider than the config's " +
                               num(plan.config.hidden) + "; across nodes the fp32 partial sums travel in windows sized by it");
  }
  if (l.num_nodes > 1 && args.topk_weights != nullptr) {
    return Status::unsupported(std::string(kOp) +
                               ": topk_weights cannot replace the routing's weights across nodes (the other nodes sum "
                               "their slots with the weights the dispatch carried); pass null");
  }
  const uint64_t row_bytes = static_cast<uint64_t>(hidden) * dtype_size(args.dtype);
  if (row_bytes % 16 != 0) {
    return Status::invalid_argument(std::string(kOp) + ": an output row is " + num(static_cast<int64_t>(row_bytes)) +
                                    " bytes; rows move as 16-byte vectors, so it must be a multiple of 16");
  }
  const size_t out_bytes = static_cast<size_t>(plan.num_tokens) * static_cast<size_t>(row_bytes);
  const size_t y_bytes = static_cast<size_t>(l.capacity) * static_cast<size_t>(row_bytes);
  const size_t pair_bytes = static_cast<size_t>(plan.num_tokens) * static_cast<size_t>(plan.config.top_k) * 4;
  if (plan.num_tokens > 0 && args.out == nullptr) return Status::invalid_argument(std::string(kOp) + ": out is null");
  LOOM_TRY_CTX(check_device(impl, args.out, out_bytes, 16, "out ([T, hidden])"), kOp);
  if (args.topk_weights != nullptr) {
    LOOM_TRY_CTX(check_device(impl, args.topk_weights, pair_bytes, 4, "topk_weights ([T, k] fp32)"), kOp);
  }
  LOOM_ASSIGN_OR_RETURN(const uint64_t y_offset,
                        check_symmetric(impl, args.expert_out, y_bytes, "moe_combine: expert_out ([capacity, hidden], symmetric)"));
  LOOM_TRY_CTX(check_disjoint({{args.out, out_bytes, "out", true},
                              {args.expert_out, y_bytes, "expert_out", false},
                              {plan.plan, static_cast<size_t>(l.plan.bytes), "the plan", false},
                              {args.topk_weights, args.topk_weights ? pair_bytes : 0, "topk_weights", false}}),
               kOp);
  LOOM_TRY_CTX(load_for_nodes(l), kOp);
  LOOM_TRY(check_staged(impl, plan, l, kOp));
  LOOM_ASSIGN_OR_RETURN(const planner::MoeCombineGrid grid,
                        planner::plan_moe_combine_grid(plan.num_tokens, impl.sm_count, options.num_ctas, l.num_nodes));

  const km::WorkspaceLayout& wl = l.workspace;
  km::CombineParams p{};
  LOOM_TRY(prepare_launch(impl, wl, wl.combine_zero_begin(), wl.combine_zero_end(), stream, kOp, p));
  fill_combine(impl, plan, l, args.topk_weights, y_offset, row_bytes, args.out, p);
  p.signature = planner::moe_signature(km::kCombineOp, {plan.config.num_experts, plan.config.top_k, l.capacity,
                                                        static_cast<int64_t>(row_bytes), plan.config.max_tokens,
                                                        job_shape(impl), static_cast<int64_t>(p.ws.offset),
                                                        static_cast<int64_t>(y_offset)});
  p.roles.set(km::CombineRole::kFinisher, 1);
  p.roles.set(km::CombineRole::kForward, static_cast<uint32_t>(grid.forward_ctas));
  const unsigned g = static_cast<unsigned>(grid.grid);
  auto launch = [&]() -> Status {
    switch (args.dtype) {
      case DType::kBF16: return ops::launch_kernel(&km::moe_combine_kernel<__nv_bfloat16>, g, MoeTunables::kThreads, 0, stream, p);
      case DType::kF16: return ops::launch_kernel(&km::moe_combine_kernel<__half>, g, MoeTunables::kThreads, 0, stream, p);
      case DType::kF32: return ops::launch_kernel(&km::moe_combine_kernel<float>, g, MoeTunables::kThreads, 0, stream, p);
    }
    return Status::invalid_argument(std::string(kOp) + ": unknown dtype");
  };
  const Status queued = launch();
  return ops::noted(comm, queued, stream);
}

namespace {

// The report's verdict from the status words.
// st.rank is a position node * L + local index: rank_at names its rank.
Status verdict_of(const km::MoeStatusWords& st, const MoePlan& plan, const std::vector<int>& rank_at) {
  const int global = st.rank >= 0 && st.rank < static_cast<int>(rank_at.size()) ? rank_at[st.rank] : st.rank;
  switch (static_cast<km::MoeError>(st.code)) {
    case km::MoeError::kNone: return {};
    case km::MoeError::kBadExpert:
      return Status::invalid_argument("moe_routing: rank " + num(global) + " token " + num(st.token) + " slot " +
                                      num(st.slot) + ": expert id " + num(st.value) + " is outside [0, " +
                                      num(plan.config.num_experts) +
                                      ") (-1 marks an unused slot); no rank moved any data (recv_x and out untouched, "
                                      "expert_offsets 0)");
    case km::MoeError::kCapacity:
      return Status::invalid_argument("moe_routing: rank " + num(global) + " would receive " + num(st.token) +
                                      " rows, more than the capacity " + num(plan.capacity) +
                                      " (MoeOverflow::kError); no rank moved any data; the largest rank needs " +
                                      num(st.max_recv_rows) + " rows (raise MoeConfig::capacity or use MoeOverflow::kDrop)");
  }
  return Status::internal("moe_routing: unknown status code " + num(st.code) + " in the plan (was it overwritten?)");
}

}  // namespace

Result<MoeReport> moe_report(Communicator& comm, const MoePlan& plan, cudaStream_t stream) {
  constexpr const char* kOp = "moe_report";
  Communicator::Impl& impl = internal(comm);
  LOOM_ASSIGN_OR_RETURN(planner::MoeLayouts l, check_plan(impl, plan, kOp));
  // The copy is queued behind the routing and waited for with the communicator's bounded wait,
  // into a pinned buffer of this host thread (allocated once: freeing pinned memory may wait for
  // the whole device). After a failed wait the copy may still be queued: the buffer is then left
  // to it (128 bytes) and the thread's next call takes a new one.
  thread_local km::MoeStatusWords* host = nullptr;
  if (host == nullptr) LOOM_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&host), sizeof(km::MoeStatusWords)));
  const Status copied = cuda_status(cudaMemcpyAsync(host, static_cast<const char*>(plan.plan) + l.plan.status,
                                                    sizeof(km::MoeStatusWords), cudaMemcpyDeviceToHost, stream),
                                    "cudaMemcpyAsync(status words)", __FILE__, __LINE__);
  const Status synced = copied.ok() ? comm.synchronize(stream) : copied;
  if (!synced.ok()) {
    host = nullptr;
    return synced;
  }
  const km::MoeStatusWords st = *host;
  return MoeReport{verdict_of(st, plan, impl.topology.rank_at), st.recv_rows, st.kept_rows, st.dropped_rows,
                   st.dropped_slots, st.max_recv_rows};
}

}  // namespace loom
