#include "planner/multinode_plan.h"

#include <algorithm>
#include <string>

#include "kernels/tp/tunables.h"
#include "planner/tp_plan.h"

namespace loom::planner {
namespace {

namespace kmn = kernels::tp::multinode;
using kernels::tp::TpTunables;

TpRequest tp_request_of(const MultiNodeRequest& r) {
  return TpRequest{.op = r.op, .m = r.m, .n = r.n, .k = r.k, .local_world = static_cast<int>(r.grid.local),
                   .nodes = static_cast<int>(r.grid.nodes), .dtype = r.dtype, .b_layout = r.b_layout, .sm_count = r.sm_count};
}

std::string shape_text(const MultiNodeRequest& r) {
  return "M=" + std::to_string(r.m) + " N=" + std::to_string(r.n) + " K=" + std::to_string(r.k) + " on " +
         std::to_string(r.grid.nodes) + " nodes x " + std::to_string(r.grid.local) + " GPUs " +
         std::string(dtype_name(r.dtype));
}

Status check_request(const MultiNodeRequest& r, const TpGemmOptions& options) {
  const std::string name(tp_op_name(r.op));
  const TpRequest t = tp_request_of(r);
  LOOM_TRY(check_tp_shape(t));
  LOOM_TRY(check_tp_options(t, options));
  const int64_t world = r.grid.world();
  if ((r.m / world) % kmn::kBlockM != 0) {
    return Status::unsupported(name + ": each rank's M/W = " + std::to_string(r.m / world) + " rows must be a multiple of " +
                               std::to_string(kmn::kBlockM) + " (" + shape_text(r) +
                               "): the multi-node kernels never let a 128-row tile span two ranks' blocks");
  }
  if (r.grid.local > static_cast<uint32_t>(TpTunables::kMaxLocalWorld)) {
    return Status::unsupported(name + ": the multi-node kernels address at most " + std::to_string(TpTunables::kMaxLocalWorld) +
                               " GPUs per node (this node has " + std::to_string(r.grid.local) + ")");
  }
  if (options.algorithm == TpAlgorithm::kDecomposed) {
    return Status::unsupported(name + ": across nodes only the fused kernel exists (no decomposed path: loom's "
                               "collectives are single-node); use TpAlgorithm::kAuto or kFused");
  }
  if (options.tile != GemmTile::kAuto && !is_fused_tile(options.tile)) {
    return Status::unsupported(name + ": the multi-node kernels are built for the 128x256 and 128x128 tiles, not " +
                               std::string(gemm_tile_name(options.tile)));
  }
  if (options.comm_ctas != -1) {
    return Status::unsupported(name + ": comm_ctas = " + std::to_string(options.comm_ctas) +
                               ": the multi-node kernels' role split is fixed (one network-send CTA; with several GPUs "
                               "per node up to " + std::to_string(TpTunables::kMaxNetRecvCtas) + " network-receive and " +
                               std::to_string(TpTunables::kNvlinkCtas) + " NVLink CTAs); leave comm_ctas at -1");
  }
  if (options.tail_pieces >= 2) {
    return Status::unsupported(name + ": tail_pieces = " + std::to_string(options.tail_pieces) +
                               ": the multi-node kernels have no tail split (it needs one node); leave tail_pieces at -1");
  }
  return {};
}

GemmTile choose_tile(const MultiNodeRequest& r, const TpGemmOptions& options) {
  if (options.tile != GemmTile::kAuto) return options.tile;
  const int sms = r.plan_sm_count > 0 ? r.plan_sm_count : r.sm_count;
  return choose_gemm_tile(r.m, r.n, r.k, sms) == GemmTile::k128x256 ? GemmTile::k128x256 : GemmTile::k128x128;
}

kmn::RoleTable roles_for(OpId op, const kmn::Grid& g) {
  kmn::RoleTable roles;
  roles.set(kmn::CtaRole::kNetSend, 1);
  if (g.local > 1 && op != OpId::kGemmRs) roles.set(kmn::CtaRole::kNetRecv, std::min(g.local - 1, TpTunables::kMaxNetRecvCtas));
  if (g.local > 1 && op == OpId::kAgGemm) roles.set(kmn::CtaRole::kNvlink, TpTunables::kNvlinkCtas);
  return roles;
}

// ag_gemm: the gathered A, chunked at about kTargetChunkBytes of its rows.
void plan_ag(const MultiNodeRequest& r, MultiNodePlan& p) {
  const GemmTileInfo info = gemm_tile_info(p.tile);
  const uint64_t row_bytes = static_cast<uint64_t>(r.k) * dtype_size(r.dtype);
  p.ag.g = r.grid;
  p.ag.rows_per_block = static_cast<uint32_t>(r.m / r.grid.world());
  p.ag.rows_per_chunk = kmn::rows_per_chunk_for(p.ag.rows_per_block, row_bytes, kmn::kTargetChunkBytes);
  p.ag.flag_base = r.flag_base;
  p.group_m = tp_group_m(r.sm_count, p.tile, p.ag.rows_per_block / info.block_m);  // never two blocks in a group
  p.rows_per_chunk = p.ag.rows_per_chunk;
  p.flags = p.ag.flags();
  p.workspace_bytes = r.gathered_a ? 0 : static_cast<size_t>(r.m * r.k) * dtype_size(r.dtype);
}

// gemm_rs / gemm_ar: the fold source (1 KiB aligned), then the send buffer. Every block's rows
// cross the network chunk by chunk (sent once all of a chunk's tiles are done, folded as its
// chunk arrives), so raster groups ramp up from one chunk to the GEMM's L2-friendly height
// (raster_ramped): with 16-row groups from the start, the first chunk was complete only after
// ~4 waves and the link idled meanwhile (h 0.58 at M = 8192, 2 emulated nodes at 50 GB/s); one
// chunk per group throughout costs L2 reuse where the GEMM is the longer part.
void plan_reduce(const MultiNodeRequest& r, MultiNodePlan& p) {
  const GemmTileInfo info = gemm_tile_info(p.tile);
  const uint64_t row_bytes = static_cast<uint64_t>(r.n) * dtype_size(r.dtype);
  kmn::ReduceLayout& l = p.reduce;
  l.g = r.grid;
  l.rows_per_block = static_cast<uint32_t>(r.m / r.grid.world());
  l.n_blocks = static_cast<uint32_t>((r.n + info.block_n - 1) / info.block_n);
  l.rows_per_chunk = kmn::rows_per_chunk_for(l.rows_per_block, row_bytes, kmn::kTargetChunkBytes);
  l.flag_base = r.flag_base;
  l.all_reduce = r.op == OpId::kGemmAr ? 1u : 0u;
  const uint32_t chunk_rows = l.tile_rows_per_chunk();
  p.ramp_m = chunk_rows;
  p.group_m = std::max(chunk_rows, tp_group_m(r.sm_count, p.tile, l.m_blocks_per_block()) / chunk_rows * chunk_rows);
  p.rows_per_chunk = l.rows_per_chunk;
  p.flags = l.flags();
  p.fold_bytes = (static_cast<size_t>(l.fold_rows()) * row_bytes + 1023) / 1024 * 1024;
  p.workspace_bytes = p.fold_bytes + static_cast<size_t>(l.send_rows()) * row_bytes;
}

}  // namespace

Result<MultiNodePlan> plan_multinode(const MultiNodeRequest& r, const TpGemmOptions& options) {
  if (r.sm_count <= 0) return Status::internal("plan_multinode: unknown SM count");
  LOOM_TRY(check_request(r, options));
  const std::string name(tp_op_name(r.op));
  MultiNodePlan p;
  p.tile = choose_tile(r, options);
  p.grid = r.sm_count;
  p.roles = roles_for(r.op, r.grid);
  if (r.op == OpId::kAgGemm) {
    plan_ag(r, p);
  } else {
    plan_reduce(r, p);
  }
  if (p.flags > r.flag_capacity) {
    return Status::unsupported(name + ": " + shape_text(r) + ": it needs " + std::to_string(p.flags) +
                               " network-window flags and the window holds " + std::to_string(r.flag_capacity) +
                               " (fewer, larger tiles or a smaller call would fit)");
  }
  if (static_cast<uint32_t>(r.sm_count) <= p.roles.rest_begin()) {
    return Status::unsupported(name + ": the GPU has too few SMs for the multi-node roles plus a compute CTA");
  }
  return p;
}

}  // namespace loom::planner
