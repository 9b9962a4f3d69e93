// loom::moe_layer: moe_dispatch_gemm's checks for both GEMMs, the buffers' checks, the plan, then
// on `stream`: the workspace's dispatch, layer and combine regions zeroed, the grouped GEMM's plan
// kernel (the routing's expert_offsets -> this rank's tile table, shared by both GEMMs), the fused
// kernel (kernels/moe/layer.cuh).
//
// Rules beyond moe_dispatch's (invalid_argument unless said): several nodes whose network flag
// window cannot hold both the dispatch's and the combine's flags of one launch (unsupported);
// config.dtype other than bf16 / fp16 (unsupported); null weights or buffers;
// intermediate not a positive multiple of 8 (unsupported, the GEMMs' rule); buffers not 16-byte
// aligned, hidden not device memory of this GPU, recv_x or expert_out not symmetric; options.phases
// not device memory of this GPU (one record per SM) or not 8-byte aligned; any written buffer
// (recv_x, hidden, expert_out, out, options.phases) overlapping another buffer; a capacity of 0 rows; a
// tile other than k128x256 / k128x128 (unsupported); CTA counts that leave no room; one shared
// weight without the other. With a shared expert, hidden and expert_out hold moe_layer_rows rows
// (the shared rows after the receive rows) and the launcher encodes their maps over all of them.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "kernels/moe/layer.cuh"
#include "loom/moe.h"
#include "ops/gemm/gemm_launch.h"
#include "ops/launch/kernel_launch.h"
#include "ops/launch/queued_work.h"
#include "ops/moe/grouped_gemm_dispatch.cuh"
#include "ops/moe/layer_launch.cuh"
#include "ops/moe/moe_launch.h"
#include "planner/moe_plan.h"
#include "runtime/network_layout.h"

namespace loom {

namespace {

namespace km = kernels::moe;
using namespace ops::moe;  // the launchers' shared checks (ops/moe/moe_launch.h)

Status launch_tile(GemmTile tile, const km::LayerParams& p, bool bf16, int grid, cudaStream_t stream) {
  switch (tile) {
    case GemmTile::k128x256: return ops::detail::launch_sm90_moe_layer_128x256(p, bf16, grid, stream);
    case GemmTile::k128x128: return ops::detail::launch_sm90_moe_layer_128x128(p, bf16, grid, stream);
    default: break;
  }
  return Status::internal("moe_layer: planner returned a tile the fused kernel is not built for");
}

// The shared expert's maps (kernels/moe/layer.cuh, LayerParams): the tokens as fc1's A for its
// tiles, its weights as one-group B maps, and hidden's and expert_out's maps re-encoded over all
// `rows` rows (the planner's grouped arguments cover the receive rows only).
Status encode_shared_expert(const MoePlan& plan, const planner::MoeLayouts& l, const void* x,
                            const MoeLayerWeights& weights, const MoeLayerBuffers& buffers,
                            const planner::MoeLayerPlan& fused, int64_t rows, km::LayerParams& p) {
  const DType dt = plan.config.dtype;
  const int64_t h = plan.config.hidden;
  const int64_t inter = weights.intermediate;
  const GemmTileInfo info = gemm_tile_info(fused.up.tile);
  LOOM_TRY(ops::encode_gemm_rows_map(buffers.hidden, rows, inter, inter, dt, info.block_m, &p.down.a));
  LOOM_TRY(ops::encode_gemm_rows_map(buffers.hidden, rows, inter, inter, dt, kernels::gemm::kTailRowBox,
                                     &p.down.a_rows));
  LOOM_TRY(ops::encode_gemm_output_map(buffers.hidden, rows, inter, inter, dt, &p.up.d));
  LOOM_TRY(ops::encode_gemm_output_map(buffers.expert_out, rows, h, h, dt, &p.down.d));
  LOOM_TRY(ops::encode_gemm_rows_map(x, plan.num_tokens, h, h, dt, info.block_m, &p.tokens));
  GemmArgs b;  // one expert's B, as the engine's B encoder reads it
  b.in_dtype = dt;
  b.b_layout = BLayout::kNK;
  b.b = weights.shared_gate_up;
  b.m = rows;
  b.n = 2 * inter;
  b.k = h;
  LOOM_TRY(ops::encode_gemm_grouped_b_map(b, 1, fused.up.tile, &p.shared_gate_up));
  b.b = weights.shared_down;
  b.n = h;
  b.k = inter;
  LOOM_TRY(ops::encode_gemm_grouped_b_map(b, 1, fused.down.tile, &p.shared_down));
  p.shared_row_begin = static_cast<uint32_t>(km::layer_shared_row_begin(static_cast<uint64_t>(l.capacity)));
  p.shared_tile_rows = static_cast<uint32_t>((plan.num_tokens + info.block_m - 1) / info.block_m);
  return {};
}

}  // namespace

Status moe_layer(Communicator& comm, const MoePlan& plan, const void* x, const MoeLayerWeights& weights,
                 const MoeLayerBuffers& buffers, void* out, cudaStream_t stream, const MoeLayerOptions& options) {
  constexpr const char* kOp = "moe_layer";
  Communicator::Impl& impl = internal(comm);
  LOOM_ASSIGN_OR_RETURN(planner::MoeLayouts l, check_plan(impl, plan, kOp));
  // Across nodes one launch holds the dispatch's network flags and, after them, the combine's.
  const runtime::net::NetWindowLayout window{static_cast<uint32_t>(l.num_nodes),
                                             static_cast<uint32_t>(impl.topology.local_world_size)};
  if (2 * l.net_flag_words > window.launch_capacity()) {
    return Status::unsupported(std::string(kOp) + ": max_tokens " + num(plan.config.max_tokens) + " on " +
                               num(l.num_nodes) + " nodes needs " + num(static_cast<int64_t>(2 * l.net_flag_words)) +
                               " network flags per call (the dispatch's and the combine's); the network flag window "
                               "holds " + num(window.launch_capacity()) +
                               " (lower max_tokens, or compose moe_dispatch_gemm, grouped_gemm and moe_combine)");
  }
  if (plan.config.dtype != DType::kBF16 && plan.config.dtype != DType::kF16) {
    return Status::unsupported(std::string(kOp) + ": config.dtype must be bf16 or fp16 (the GEMMs' inputs)");
  }
  if (weights.gate_up == nullptr || weights.down == nullptr) {
    return Status::invalid_argument(std::string(kOp) + ": weights.gate_up and weights.down must not be null");
  }
  if (buffers.hidden == nullptr || buffers.expert_out == nullptr) {
    return Status::invalid_argument(std::string(kOp) + ": buffers.hidden and buffers.expert_out must not be null");
  }
  if ((weights.shared_gate_up == nullptr) != (weights.shared_down == nullptr)) {
    return Status::invalid_argument(std::string(kOp) + ": weights.shared_gate_up and weights.shared_down go together "
                                    "(both: a shared expert; neither: none)");
  }
  const bool shared = weights.shared_gate_up != nullptr;
  if (weights.intermediate <= 0 || weights.intermediate % 8 != 0) {
    return Status::unsupported(std::string(kOp) + ": intermediate " + num(weights.intermediate) +
                               " must be a positive multiple of 8 (the down GEMM's K rows are 16-byte aligned)");
  }
  if (l.capacity == 0) {
    return Status::invalid_argument(std::string(kOp) + ": the config's capacity is 0 rows (max_tokens 0): no row to "
                                    "compute on");
  }
  LOOM_ASSIGN_OR_RETURN(const uint64_t recv_offset, check_dispatch_buffers(impl, plan, l, x, buffers.recv_x, kOp));

  alignas(16) static char placeholder[16];  // the tile table's address is known after the workspace
  GroupedGemmArgs up = planner::layer_up_args(plan, l, weights, buffers, placeholder);
  GroupedGemmArgs down = planner::layer_down_args(plan, l, weights, buffers, placeholder);
  const size_t elem = dtype_size(plan.config.dtype);
  const size_t hidden_elems = static_cast<size_t>(plan.config.hidden);
  const size_t inter = static_cast<size_t>(weights.intermediate);
  const size_t experts = static_cast<size_t>(l.local_experts);
  const size_t gate_up_bytes = experts * 2 * inter * hidden_elems * elem;
  const size_t down_bytes = experts * hidden_elems * inter * elem;
  const int64_t layer_rows = moe_layer_rows(l.capacity, plan.config.max_tokens, shared);
  const size_t rows = static_cast<size_t>(layer_rows);
  const size_t hidden_bytes = rows * inter * elem;
  const size_t y_bytes = rows * static_cast<size_t>(l.row_bytes);
  const size_t out_bytes = token_bytes(plan, l);
  const size_t shared_gate_up_bytes = shared ? gate_up_bytes / experts : 0;
  const size_t shared_down_bytes = shared ? down_bytes / experts : 0;
  const char* rows_name = shared ? "moe_layer_rows(capacity, max_tokens, true)" : "capacity";
  LOOM_TRY_CTX(check_device(impl, weights.gate_up, gate_up_bytes, 16, "weights.gate_up ([E/W, 2I, H])"), kOp);
  LOOM_TRY_CTX(check_device(impl, weights.down, down_bytes, 16, "weights.down ([E/W, H, I])"), kOp);
  if (shared) {
    LOOM_TRY_CTX(
        check_device(impl, weights.shared_gate_up, shared_gate_up_bytes, 16, "weights.shared_gate_up ([2I, H])"), kOp);
    LOOM_TRY_CTX(check_device(impl, weights.shared_down, shared_down_bytes, 16, "weights.shared_down ([H, I])"), kOp);
  }
  const std::string hidden_what = "buffers.hidden ([" + std::string(rows_name) + " = " + num(layer_rows) + ", I])";
  const std::string y_what =
      "moe_layer: buffers.expert_out ([" + std::string(rows_name) + " = " + num(layer_rows) + ", H], symmetric)";
  LOOM_TRY_CTX(check_device(impl, buffers.hidden, hidden_bytes, 16, hidden_what.c_str()), kOp);
  LOOM_ASSIGN_OR_RETURN(const uint64_t y_offset, check_symmetric(impl, buffers.expert_out, y_bytes, y_what.c_str()));
  if (plan.num_tokens > 0 && out == nullptr) return Status::invalid_argument(std::string(kOp) + ": out is null");
  LOOM_TRY_CTX(check_device(impl, out, out_bytes, 16, "out ([T, H])"), kOp);
  // Diagnostics: one record per SM is always enough (the grid never has more CTAs).
  const size_t phases_bytes = options.phases != nullptr ? static_cast<size_t>(impl.sm_count) * sizeof(MoeLayerPhaseRecord) : 0;
  if (options.phases != nullptr) {
    const std::string what = "options.phases (" + num(impl.sm_count) + " MoeLayerPhaseRecord, one per SM)";
    LOOM_TRY_CTX(check_device(impl, options.phases, phases_bytes, 8, what.c_str()), kOp);
  }
  LOOM_TRY_CTX(check_disjoint({{buffers.recv_x, receive_bytes(l), "buffers.recv_x", true},
                              {buffers.hidden, hidden_bytes, hidden_what.c_str(), true},  // names its row count
                              {buffers.expert_out, y_bytes, "buffers.expert_out", true},
                              {out, out_bytes, "out", true},
                              {options.phases, phases_bytes, "options.phases", true},
                              {x, out_bytes, "x", false},
                              {weights.gate_up, gate_up_bytes, "weights.gate_up", false},
                              {weights.down, down_bytes, "weights.down", false},
                              {weights.shared_gate_up, shared_gate_up_bytes, "weights.shared_gate_up", false},
                              {weights.shared_down, shared_down_bytes, "weights.shared_down", false},
                              {plan.plan, static_cast<size_t>(l.plan.bytes), "the plan", false}}),
               kOp);
  LOOM_ASSIGN_OR_RETURN(planner::GemmDeviceLimits limits, ops::gemm_device_limits());
  limits.sm_count = impl.sm_count;
  LOOM_ASSIGN_OR_RETURN(const planner::MoeLayerPlan fused,
                        planner::plan_moe_layer(up, down, options, limits, {l.world, l.num_nodes}));
  LOOM_TRY_CTX(load_for_nodes(l), kOp);

  const km::WorkspaceLayout& wl = l.workspace;
  km::LayerParams p{};
  km::DispatchParams& d = p.dispatch;
  LOOM_TRY(prepare_launch(impl, wl, wl.dispatch_zero_begin(), wl.combine_zero_end(), stream, kOp, d));
  fill_dispatch(impl, plan, l, x, recv_offset, km::kLayerOp, d);
  d.signature = planner::moe_signature(km::kLayerOp, {plan.config.num_experts, plan.config.top_k, l.capacity,
                                                      static_cast<int64_t>(l.row_bytes), plan.config.max_tokens,
                                                      job_shape(impl), static_cast<int64_t>(d.ws.offset),
                                                      static_cast<int64_t>(recv_offset), weights.intermediate,
                                                      static_cast<int64_t>(y_offset), shared ? 1 : 0});
  void* table = static_cast<char*>(impl.heap->local_base()) + d.ws.offset + wl.tiles;  // both GEMMs' tile table
  up.workspace = table;
  down.workspace = table;
  LOOM_TRY_CTX(ops::prepare_grouped_gemm(up, fused.up, stream, p.up), kOp);
  LOOM_TRY_CTX(ops::encode_grouped_gemm(down, fused.down, p.down), kOp);
  p.up.swap_tails = p.down.swap_tails = options.swap_tails ? 1u : 0u;
  p.up.expert_groups = options.expert_groups ? 1u : 0u;  // the scheduler reads up's for both GEMMs
  if (shared && plan.num_tokens > 0) {
    LOOM_TRY_CTX(encode_shared_expert(plan, l, x, weights, buffers, fused, layer_rows, p), kOp);
  }
  char* ws = static_cast<char*>(impl.heap->local_base()) + d.ws.offset;  // this rank's layer regions
  p.hidden_done = reinterpret_cast<uint64_t*>(ws + wl.hidden_done);
  p.out_done = reinterpret_cast<uint64_t*>(ws + wl.out_done);
  p.out_ready = reinterpret_cast<uint64_t*>(ws + wl.out_ready);
  p.pushes_done = reinterpret_cast<uint64_t*>(ws + wl.pushes_done);
  p.phases = options.phases;
  if (p.phases != nullptr) {
    LOOM_CUDA_TRY(cudaMemsetAsync(p.phases, 0, static_cast<size_t>(fused.grid) * sizeof(MoeLayerPhaseRecord), stream));
  }

  km::CombineParams& cp = p.combine;
  static_cast<km::LaunchCommon&>(cp) = static_cast<const km::LaunchCommon&>(d);
  fill_combine(impl, plan, l, nullptr, y_offset, l.row_bytes, out, cp);  // the routing's weights
  cp.signature = d.signature;
  cp.net_flag_base = d.net_flag_base + static_cast<uint32_t>(l.net_flag_words);  // after the dispatch's
  if (p.shared_tile_rows > 0) {  // this rank's expert_out rows of its tokens' shared expert
    cp.addend = static_cast<const char*>(buffers.expert_out) + static_cast<uint64_t>(p.shared_row_begin) * l.row_bytes;
  }

  p.roles.set(km::LayerRole::kArrival, static_cast<uint32_t>(fused.arrival_ctas));
  p.roles.set(km::LayerRole::kForward, static_cast<uint32_t>(fused.forward_ctas));
  p.roles.set(km::LayerRole::kPush, static_cast<uint32_t>(fused.push_ctas));
  const Status queued = launch_tile(fused.up.tile, p, plan.config.dtype == DType::kBF16, fused.grid, stream);
  if (queued.ok()) LOOM_TRY(note_staged(impl, plan));  // its dispatch staged this plan's entries
  return ops::noted(comm, queued, stream);
}

}  // namespace loom
