// gemm_rs and gemm_ar in one NVLink domain (kernel: kernels/tp/sm90_staged_reduce.cuh): plan,
// buffer checks, launch (plain GEMM, decomposed or fused), the two operators alike.
//
// Rules beyond tp_common.h: a is this GPU's device memory [M, K] (K = this rank's K_r); b [K, N]
// or [N, K]; gemm_rs' out [M/W, N] on this GPU, gemm_ar's out [M, N] symmetric; out overlaps
// neither a nor b.
#include <cuda_runtime_api.h>

#include <string>

#include "core/log.h"
#include "loom/gemm.h"
#include "ops/collectives/common.h"
#include "ops/gemm/gemm_launch.h"
#include "ops/launch/family_resources.h"
#include "ops/launch/kernel_launch.h"
#include "ops/launch/signature.h"
#include "ops/tp/staged_reduce.h"
#include "ops/tp/tp_common.h"
#include "runtime/cuda_check.h"

namespace loom::ops::tp {
namespace {

namespace kt = kernels::tp;
namespace kg = kernels::gemm;
using kt::TpTunables;

template <bool kBroadcast>
constexpr OpId kOp = kBroadcast ? OpId::kGemmAr : OpId::kGemmRs;

// Rows of one owner per band of the rank-banded order: the fewest tile rows dividing the
// owner's rows whose tiles fill kBandWaves waves of the grid (all of them if none does).
int64_t band_m_blocks_for(int64_t rank_blocks, int64_t n_blocks, int grid) {
  for (int64_t q = 1; q <= rank_blocks; ++q) {
    if (rank_blocks % q == 0 && q * n_blocks >= static_cast<int64_t>(TpTunables::kBandWaves) * grid) return q;
  }
  return rank_blocks;
}

// The tail split of a fused launch (planner::plan_tail_split): the order's last band (own tiles)
// may be split.
planner::TailSplit reduce_tail_split(const TpGemmArgs& a, GemmTile tile, int grid, int world, int requested) {
  const GemmTileInfo info = gemm_tile_info(tile);
  const int64_t n_blocks = (a.n + info.block_n - 1) / info.block_n;
  const int64_t m_blocks = a.m / info.block_m;
  const int64_t band = band_m_blocks_for(m_blocks / world, n_blocks, grid);
  const int64_t k_blocks = (a.k + info.block_k - 1) / info.block_k;
  return planner::plan_tail_split(m_blocks * n_blocks, grid, k_blocks, info.stages, band * n_blocks, requested);
}

// Flags a fused launch uses after the entry words: the partial flags, gemm_ar's final flags, the
// piece flags.
uint64_t reduce_flags_for(int64_t m, int64_t n, int world, GemmTile tile, bool broadcast, int64_t piece_slots) {
  const GemmTileInfo info = gemm_tile_info(tile);
  const uint64_t n_blocks = static_cast<uint64_t>((n + info.block_n - 1) / info.block_n);
  const uint64_t m_blocks = static_cast<uint64_t>(m / info.block_m);
  const uint64_t own_tiles = m_blocks / static_cast<uint64_t>(world) * n_blocks;
  return static_cast<uint64_t>(world - 1) * own_tiles + (broadcast ? m_blocks * n_blocks : 0) +
         static_cast<uint64_t>(piece_slots);
}

// The staged partials a fused launch needs in every rank's workspace: the other ranks' partials
// of this rank's rows, then (1 KiB aligned) the piece slots of a tail split.
size_t peer_staging_bytes(const TpGemmArgs& a, int world) {
  const size_t bytes = static_cast<size_t>(world - 1) * static_cast<size_t>(a.m / world) * static_cast<size_t>(a.n) *
                       dtype_size(a.dtype);
  return (bytes + 1023) / 1024 * 1024;
}

template <bool kBroadcast>
Result<TpCall> plan(Communicator::Impl& impl, const TpGemmArgs& args, const TpGemmOptions& options) {
  LOOM_TRY(check_common(impl, kOp<kBroadcast>, args));
  const int world = impl.topology.local_world_size;
  auto fused_check = [&](GemmTile tile, int grid) -> std::string {
    const int64_t pieces = piece_slots_of(reduce_tail_split(args, tile, grid, world, options.tail_pieces));
    return check_flag_capacity(impl, reduce_flags_for(args.m, args.n, world, tile, kBroadcast, pieces));
  };
  LOOM_ASSIGN_OR_RETURN(TpCall call, decide(impl, kOp<kBroadcast>, args, options, fused_check));
  if (call.info.path == TpPath::kDecomposed && !kBroadcast) {
    call.info.workspace_bytes = static_cast<size_t>(args.m * args.n) * dtype_size(args.dtype);  // the partial product
  }
  if (call.info.path != TpPath::kFused) return call;
  call.split = reduce_tail_split(args, call.info.tile, call.info.ctas, world, options.tail_pieces);
  note_tail_split(call);
  call.info.workspace_bytes =
      peer_staging_bytes(args, world) + piece_slot_bytes(piece_slots_of(call.split), call.info.tile, args.dtype);
  return call;
}

template <bool kBroadcast>
Status check_buffers(Communicator::Impl& impl, const TpGemmArgs& a) {
  return check_reduce_buffers(impl, kOp<kBroadcast>, a, kBroadcast ? a.m : a.m / impl.topology.local_world_size);
}

// gemm_rs: GEMM into the workspace, then loom's reduce_scatter into out. gemm_ar: GEMM into out,
// then loom's all_reduce in place (each rank reduces and pushes its own chunk of out, reading
// every rank's copy of that chunk before anyone writes it: collectives.h).
template <bool kBroadcast>
Status run_decomposed(Communicator& comm, const TpGemmArgs& a, const TpCall& call, cudaStream_t stream) {
  if constexpr (kBroadcast) {
    LOOM_TRY(gemm(local_gemm(a.a, a.b, a.out, a.m, a), stream, gemm_options_for(call)));
    return all_reduce_for(comm, a.out, a.out, static_cast<size_t>(a.m * a.n), a.dtype, stream, {}, OpId::kGemmAr,
                          decomposed_tp_signature(OpId::kGemmAr, a, comm.local_world_size()))
        .with_context("gemm_ar (decomposed)");
  } else {
    LOOM_ASSIGN_OR_RETURN(void* partial, family_workspace(internal(comm), kFamily, call.info.workspace_bytes, stream, "gemm_rs"));
    LOOM_TRY(gemm(local_gemm(a.a, a.b, partial, a.m, a), stream, gemm_options_for(call)));
    const size_t rows = static_cast<size_t>(a.m / comm.local_world_size());
    return reduce_scatter_for(comm, partial, a.out, rows * static_cast<size_t>(a.n), a.dtype, stream, {}, OpId::kGemmRs,
                              decomposed_tp_signature(OpId::kGemmRs, a, comm.local_world_size()))
        .with_context("gemm_rs (decomposed)");
  }
}

// The fused launch's kernel parameters. `staging` is this rank's TP workspace (equal offset on
// every rank); gemm_ar's out is symmetric.
Status build_params(Communicator::Impl& impl, const TpGemmArgs& a, const TpCall& call, void* staging, bool broadcast,
                    kt::ReduceGemmParams* out_params) {
  kt::ReduceGemmParams& p = *out_params;
  const int world = impl.topology.local_world_size;
  const int me = impl.topology.local_rank;
  const GemmTile tile = call.info.tile;
  const GemmTileInfo info = gemm_tile_info(tile);
  const int64_t rows = a.m / world;
  const int64_t staging_rows = static_cast<int64_t>(world - 1) * rows;
  const uint64_t staging_offset = impl.heap->offset_of(staging);

  LOOM_TRY(encode_gemm_operand_maps(local_gemm(a.a, a.b, a.out, a.m, a), tile, &p.a, &p.b));
  LOOM_TRY(encode_gemm_rows_map(staging, staging_rows, a.n, a.n, a.dtype, info.block_m, &p.staged));
  if (broadcast) {
    const uint64_t out_offset = impl.heap->offset_of(a.out);
    for (int r = 0; r < world; ++r) {
      void* out_r = static_cast<char*>(impl.heap->peer_base(r)) + out_offset;
      LOOM_TRY(encode_gemm_output_map(out_r, a.m, a.n, a.n, a.dtype, &p.out[r]));
    }
  } else {
    LOOM_TRY(encode_gemm_output_map(a.out, rows, a.n, a.n, a.dtype, &p.out[0]));
  }
  for (int r = 0; r < world; ++r) {
    if (r == me) continue;
    void* staging_r = static_cast<char*>(impl.heap->peer_base(r)) + staging_offset;
    LOOM_TRY(encode_gemm_output_map(staging_r, staging_rows, a.n, a.n, a.dtype, &p.stage_to[r]));
  }
  p.comm = impl.device_comm();
  LOOM_ASSIGN_OR_RETURN(p.state, family_launch_state(impl, kFamily));
  p.m = static_cast<uint32_t>(a.m);
  p.n = static_cast<uint32_t>(a.n);
  p.k = static_cast<uint32_t>(a.k);

  const int64_t m_blocks = a.m / info.block_m;
  const int64_t n_blocks = (a.n + info.block_n - 1) / info.block_n;
  const int64_t rank_blocks = rows / info.block_m;
  const int64_t band = band_m_blocks_for(rank_blocks, n_blocks, call.info.ctas);
  kg::SchedulerParams& s = p.sched;
  s.m_rows = p.m;
  s.m_blocks = static_cast<uint32_t>(m_blocks);
  s.n_blocks = static_cast<uint32_t>(n_blocks);
  s.group_m = planner::tp_group_m(call.info.ctas, tile, band);  // a raster group never spans two owners
  s.queue = &p.state->tile_queue;
  kt::TpSchedulerParams& t = p.tiles;
  t.order_world = static_cast<uint32_t>(world);
  t.order_self = static_cast<uint32_t>(me);
  t.order_owner_offset = 1;  // the next rank's rows first, our own last in every band
  t.order_m_blocks_per_rank = static_cast<uint32_t>(rank_blocks);
  t.order_band_m_blocks = static_cast<uint32_t>(band);
  t.fold_m_begin = static_cast<uint32_t>(me * rank_blocks);
  t.fold_m_end = static_cast<uint32_t>((me + 1) * rank_blocks);
  // Local only: pieces are staged and folded by this rank (peers never address them).
  LOOM_TRY(set_tail_split(call.split, static_cast<char*>(staging) + peer_staging_bytes(a, world), tile, a.dtype, a.k,
                          world + reduce_flags_for(a.m, a.n, world, tile, broadcast, 0), &p.split, &p.pieces));

  p.rows_per_rank = static_cast<uint32_t>(rows);
  p.m_blocks_per_rank = static_cast<uint32_t>(rank_blocks);
  p.n_blocks = static_cast<uint32_t>(n_blocks);
  p.out_dtype = static_cast<uint32_t>(a.dtype);
  p.timeline = call.timeline;
  // Heap offsets are part of the plan: peers address this rank's staging (and gemm_ar's out) by
  // their own offsets.
  const int64_t out_offset = broadcast ? static_cast<int64_t>(impl.heap->offset_of(a.out)) : 0;
  p.signature = plan_signature(broadcast ? OpId::kGemmAr : OpId::kGemmRs, tile, world,
                               {a.m, a.n, static_cast<int64_t>(a.dtype), static_cast<int64_t>(staging_offset), out_offset});
  LOOM_DEBUG("%s fused %s: tile %s, %d CTAs, bands of %lld tile rows, last %lld tiles in %d K pieces, plan from %s",
             broadcast ? "gemm_ar" : "gemm_rs", shape_text(a, world).c_str(), std::string(gemm_tile_name(tile)).c_str(),
             call.info.ctas, static_cast<long long>(band), static_cast<long long>(call.info.tail_tiles),
             call.info.tail_tiles > 0 ? call.info.tail_pieces : 1, call.plan.source.c_str());
  return {};
}

template <bool kBroadcast>
Status run_fused(Communicator& comm, const TpGemmArgs& a, const TpCall& call, cudaStream_t stream) {
  Communicator::Impl& impl = internal(comm);
  const char* name = kBroadcast ? "gemm_ar" : "gemm_rs";
  LOOM_ASSIGN_OR_RETURN(void* staging, family_workspace(impl, kFamily, call.info.workspace_bytes, stream, name));
  kt::ReduceGemmParams p{};
  LOOM_TRY(build_params(impl, a, call, staging, kBroadcast, &p));
  LOOM_ASSIGN_OR_RETURN(const ReduceKernel kernel, staged_reduce_kernel<kBroadcast>(call.info.tile, a.dtype, a.b_layout));
  return launch_kernel(kernel.fn, static_cast<unsigned>(call.info.ctas), kernel.threads, kernel.smem_bytes, stream, p);
}

template <bool kBroadcast>
Status launch(Communicator& comm, const TpCall& call, const TpGemmArgs& args, cudaStream_t stream) {
  switch (call.info.path) {
    case TpPath::kPlainGemm: return gemm(local_gemm(args.a, args.b, args.out, args.m, args), stream, gemm_options_for(call));
    case TpPath::kDecomposed: return run_decomposed<kBroadcast>(comm, args, call, stream);
    case TpPath::kFused: return run_fused<kBroadcast>(comm, args, call, stream);
    case TpPath::kMultiNode: break;
  }
  return Status::internal(std::string(kBroadcast ? "gemm_ar" : "gemm_rs") + ": a one-node call planned a multi-node path");
}

template <bool kBroadcast>
constexpr TpOperator kOperator{kOp<kBroadcast>, kFamily, plan<kBroadcast>, check_buffers<kBroadcast>, launch<kBroadcast>};

}  // namespace

const TpOperator& gemm_rs_operator() { return kOperator<false>; }
const TpOperator& gemm_ar_operator() { return kOperator<true>; }

}  // namespace loom::ops::tp
