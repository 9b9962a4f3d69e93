// ag_gemm in one NVLink domain (kernel: kernels/tp/sm90_ag_gemm.cuh): plan, buffer checks,
// launch (plain GEMM, decomposed or fused); instantiates its 8 kernels.
//
// Rules beyond tp_common.h: a is this GPU's device memory [M/W, K]; b [K, N] or [N, K]; out
// [M, N] (this GPU); gathered_a, when given, symmetric [M, K] (it receives AllGather(a); a may be
// its own rows, in place). out must not overlap a, b or gathered_a.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>

#include "core/log.h"
#include "kernels/tp/sm90_ag_gemm.cuh"
#include "loom/gemm.h"
#include "ops/collectives/common.h"
#include "ops/gemm/gemm_launch.h"
#include "ops/launch/family_resources.h"
#include "ops/launch/kernel_launch.h"
#include "ops/launch/signature.h"
#include "ops/tp/fused_kernel.h"
#include "ops/tp/tp_common.h"
#include "runtime/cuda_check.h"

namespace loom::ops::tp {
namespace {

namespace kt = kernels::tp;
namespace kg = kernels::gemm;
constexpr OpId kOp = OpId::kAgGemm;

// ag_gemm's tail split (planner::plan_tail_split) with the tiles the pushing comm CTAs leave to
// the last wave (planner::ag_late_claims). Any tile may be split (the pieces are this rank's own
// business; a piece waits for its rows like its tile would). The chunking and the late claims
// count only the peers as destinations: the copy into a user-visible gathered A may differ
// between ranks, the plan (workspace size, flags) must not.
planner::TailSplit ag_tail_split(const TpGemmArgs& a, int world, GemmTile tile, int grid, int comm_ctas,
                                 int64_t rows_per_flag, int requested) {
  const GemmTileInfo info = gemm_tile_info(tile);
  const int64_t tiles = ((a.m + info.block_m - 1) / info.block_m) * ((a.n + info.block_n - 1) / info.block_n);
  const int64_t k_blocks = (a.k + info.block_k - 1) / info.block_k;
  const int64_t late = planner::ag_late_claims(tp_request(kOp, a, world, grid), tile, comm_ctas, rows_per_flag, world - 1);
  return planner::plan_tail_split(tiles, grid, k_blocks, info.stages, tiles, requested, late);
}

// The fused launch's workspace: the gathered A unless the caller gave one (1 KiB aligned), then
// the piece slots of a tail split.
size_t fused_gathered_bytes(const TpGemmArgs& a) {
  return a.gathered_a == nullptr ? (static_cast<size_t>(a.m * a.k) * dtype_size(a.dtype) + 1023) / 1024 * 1024 : 0;
}

Result<TpCall> plan(Communicator::Impl& impl, const TpGemmArgs& args, const TpGemmOptions& options) {
  LOOM_TRY(check_common(impl, kOp, args));
  const int world = impl.topology.local_world_size;
  const uint64_t row_bytes = static_cast<uint64_t>(args.k) * dtype_size(args.dtype);
  auto fused_check = [&](GemmTile /*tile*/, int grid) -> std::string {
    if (options.comm_ctas == 0) return "comm_ctas = 0: the fused ag_gemm needs a communication CTA to push the shard";
    if (grid < 2) return "the GPU has fewer than 2 SMs";
    // At most: the finest chunks (every CTA but one pushing to one destination), and the last
    // wave of tiles split into the most pieces a plan can ask for.
    const int64_t rows_per_flag = planner::ag_rows_per_flag(args.m / world, row_bytes, grid - 1, 1);
    const int most_pieces = std::max(options.tail_pieces, planner::TpCostModel{}.max_tail_pieces);
    const int64_t flags = args.m / rows_per_flag + static_cast<int64_t>(grid) * (most_pieces - 1);
    return check_flag_capacity(impl, static_cast<uint64_t>(flags));
  };
  LOOM_ASSIGN_OR_RETURN(TpCall call, decide(impl, kOp, args, options, fused_check));
  if (call.info.path == TpPath::kDecomposed && args.gathered_a == nullptr) {
    call.info.workspace_bytes = static_cast<size_t>(args.m * args.k) * dtype_size(args.dtype);  // the gathered A
  }
  if (call.info.path != TpPath::kFused) return call;
  call.info.comm_ctas = std::clamp(call.plan.comm_ctas, 1, call.info.ctas - 1);
  call.rows_per_flag = planner::ag_rows_per_flag(args.m / world, row_bytes, call.info.comm_ctas, world - 1);
  call.split = ag_tail_split(args, world, call.info.tile, call.info.ctas, call.info.comm_ctas, call.rows_per_flag,
                             options.tail_pieces);
  note_tail_split(call);
  call.info.workspace_bytes =
      fused_gathered_bytes(args) + piece_slot_bytes(piece_slots_of(call.split), call.info.tile, args.dtype);
  return call;
}

Status check_buffers(Communicator::Impl& impl, const TpGemmArgs& a) {
  return check_ag_buffers(impl, a, impl.topology.local_world_size, impl.topology.local_rank,
                          "gathered_a + local_rank * M/W * K");
}

Status run_plain(const TpGemmArgs& a, const TpCall& call, cudaStream_t stream) {
  const size_t bytes = static_cast<size_t>(a.m * a.k) * dtype_size(a.dtype);
  if (a.gathered_a != nullptr && a.gathered_a != a.a) {
    LOOM_CUDA_TRY(cudaMemcpyAsync(a.gathered_a, a.a, bytes, cudaMemcpyDeviceToDevice, stream));
  }
  return gemm(local_gemm(a.a, a.b, a.out, a.m, a), stream, gemm_options_for(call));
}

Status run_decomposed(Communicator& comm, const TpGemmArgs& a, const TpCall& call, cudaStream_t stream) {
  Communicator::Impl& impl = internal(comm);
  void* gathered = a.gathered_a;
  if (gathered == nullptr) {
    LOOM_ASSIGN_OR_RETURN(gathered, family_workspace(impl, kFamily, call.info.workspace_bytes, stream, "ag_gemm"));
  }
  const size_t shard = static_cast<size_t>(a.m / impl.topology.local_world_size * a.k);
  LOOM_TRY_CTX(all_gather_for(comm, a.a, gathered, shard, a.dtype, stream, {}, kOp,
                              decomposed_tp_signature(kOp, a, impl.topology.local_world_size)),
               "ag_gemm (decomposed)");
  return gemm(local_gemm(gathered, a.b, a.out, a.m, a), stream, gemm_options_for(call));
}

Status run_fused(Communicator& comm, const TpGemmArgs& a, const TpCall& call, cudaStream_t stream) {
  Communicator::Impl& impl = internal(comm);
  const int world = impl.topology.local_world_size;
  const int me = impl.topology.local_rank;
  const size_t e = dtype_size(a.dtype);
  const int64_t rows = a.m / world;
  const GemmTile tile = call.info.tile;
  const GemmTileInfo info = gemm_tile_info(tile);
  const int64_t piece_slots = piece_slots_of(call.split);
  const size_t gathered_bytes = fused_gathered_bytes(a);
  void* workspace = nullptr;
  if (call.info.workspace_bytes > 0) {
    LOOM_ASSIGN_OR_RETURN(workspace, family_workspace(impl, kFamily, call.info.workspace_bytes, stream, "ag_gemm"));
  }
  void* gathered = a.gathered_a != nullptr ? a.gathered_a : workspace;

  kt::AgGemmParams p{};
  LOOM_TRY(set_ag_operands(impl, kFamily, a, gathered, rows, tile, &p));

  const int64_t rank_blocks = rows / info.block_m;
  kg::SchedulerParams& s = p.sched;
  s.m_rows = p.m;
  s.m_blocks = static_cast<uint32_t>(a.m / info.block_m);
  s.n_blocks = static_cast<uint32_t>((a.n + info.block_n - 1) / info.block_n);
  s.group_m = planner::tp_group_m(call.info.ctas, tile, rank_blocks);  // groups never straddle two ranks' rows
  s.m_block_start = static_cast<uint32_t>(me * rank_blocks);           // our rows first: they wait for nothing
  s.queue = &p.state->tile_queue;
  kt::TpSchedulerParams& t = p.tiles;
  t.row_flags = reinterpret_cast<const uint64_t*>(static_cast<char*>(impl.heap->local_base()) + impl.control.op_flag_offset) +
                world;
  t.rows_per_flag = static_cast<uint32_t>(call.rows_per_flag);
  t.rows_per_source = static_cast<uint32_t>(rows);
  t.ungated_begin = static_cast<uint32_t>(me * rows);
  t.ungated_end = static_cast<uint32_t>((me + 1) * rows);
  LOOM_TRY(set_tail_split(call.split, piece_slots > 0 ? static_cast<char*>(workspace) + gathered_bytes : nullptr, tile, a.dtype,
                          a.k, world + a.m / call.rows_per_flag /* after the rows flags */, &p.split, &p.pieces));

  p.rows_per_rank = static_cast<uint32_t>(rows);
  p.rows_per_flag = static_cast<uint32_t>(call.rows_per_flag);
  p.comm_ctas = static_cast<uint32_t>(call.info.comm_ctas);
  const char* own_rows = static_cast<const char*>(gathered) + static_cast<size_t>(me) * rows * a.k * e;
  p.copy_local = a.gathered_a != nullptr && a.a != own_rows ? 1u : 0u;
  p.timeline = call.timeline;
  // The gathered A's heap offset is part of the plan: peers push into it by their own offset.
  p.signature = plan_signature(kOp, tile, world,
                               {a.m, a.k, call.rows_per_flag, static_cast<int64_t>(a.dtype), static_cast<int64_t>(p.gathered_offset)});

  LOOM_DEBUG("ag_gemm fused %s: tile %s, %d CTAs (%d communicate first), %lld rows per flag, last %lld tiles in %d K "
             "pieces, plan from %s",
             shape_text(a, world).c_str(), std::string(gemm_tile_name(tile)).c_str(), call.info.ctas, call.info.comm_ctas,
             static_cast<long long>(call.rows_per_flag), static_cast<long long>(call.info.tail_tiles),
             piece_slots > 0 ? call.split.pieces : 1, call.plan.source.c_str());
  LOOM_ASSIGN_OR_RETURN(const FusedKernel<kt::AgGemmParams> kernel,
                        fused_kernel<kt::AgGemmParams>(tile, a.dtype, a.b_layout, [&]<class Cfg, bool kBF16, bool kBNMajor>() {
                          return &kt::ag_gemm_kernel<Cfg, kBF16, kBNMajor>;
                        }));
  return launch_kernel(kernel.fn, static_cast<unsigned>(call.info.ctas), kernel.threads, kernel.smem_bytes, stream, p);
}

Status launch(Communicator& comm, const TpCall& call, const TpGemmArgs& args, cudaStream_t stream) {
  switch (call.info.path) {
    case TpPath::kPlainGemm: return run_plain(args, call, stream);
    case TpPath::kDecomposed: return run_decomposed(comm, args, call, stream);
    case TpPath::kFused: return run_fused(comm, args, call, stream);
    case TpPath::kMultiNode: break;
  }
  return Status::internal("ag_gemm: a one-node call planned a multi-node path");
}

constexpr TpOperator kOperator{kOp, kFamily, plan, check_buffers, launch};

}  // namespace

const TpOperator& ag_gemm_operator() { return kOperator; }

}  // namespace loom::ops::tp
