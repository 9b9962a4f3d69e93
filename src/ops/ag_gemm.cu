// Host launcher of ag_gemm: validate -> plan -> workspace -> launch (kernel: kernels/tp/ag_gemm.cuh).
//
// Rules beyond tp_common.h: a is this GPU's device memory [M/W, K]; b [K, N] or [N, K]; out
// [M, N] (this GPU); gathered_a, when given, symmetric [M, K] (it receives AllGather(a); a may be
// its own rows, in place). out must not overlap a, b or gathered_a.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>

#include "kernels/tp/ag_gemm.cuh"
#include "loom/collectives.h"
#include "loom/gemm.h"
#include "ops/collective_common.h"
#include "ops/launch/queued_work.h"
#include "ops/multinode.h"
#include "ops/tp_common.h"

namespace loom {
namespace {

namespace kt = kernels::tp;
namespace kg = kernels::gemm;
using ops::tp::TpDecision;
using ops::tp::TpPath;

Status check_buffers(Communicator::Impl& impl, const TpGemmArgs& a) {
  const int world = impl.topology.local_world_size;
  const size_t e = dtype_size(a.dtype);
  const int64_t rows = a.m / world;
  LOOM_TRY_CTX(impl.check_local_device_buffer(a.a, static_cast<size_t>(rows * a.k) * e, "a ([M/W, K])"), "ag_gemm");
  LOOM_TRY_CTX(impl.check_local_device_buffer(a.b, static_cast<size_t>(a.k * a.n) * e, "b"), "ag_gemm");
  LOOM_TRY_CTX(impl.check_local_device_buffer(a.out, static_cast<size_t>(a.m * a.n) * e, "out ([M, N])"), "ag_gemm");
  const ops::tp::ByteRange out = ops::tp::bytes_of(a.out, a.m, a.n, e);
  const ops::tp::ByteRange in_a = ops::tp::bytes_of(a.a, rows, a.k, e);
  const ops::tp::ByteRange in_b = ops::tp::bytes_of(a.b, a.k, a.n, e);
  if (out.overlaps(in_a)) return Status::invalid_argument("ag_gemm: out overlaps a");
  if (out.overlaps(in_b)) return Status::invalid_argument("ag_gemm: out overlaps b");
  if (a.gathered_a != nullptr) {
    LOOM_ASSIGN_OR_RETURN(uint64_t offset,
                          impl.symmetric_offset(a.gathered_a, static_cast<size_t>(a.m * a.k) * e, "ag_gemm: gathered_a ([M, K])"));
    (void)offset;
    const ops::tp::ByteRange gathered = ops::tp::bytes_of(a.gathered_a, a.m, a.k, e);
    if (out.overlaps(gathered)) return Status::invalid_argument("ag_gemm: out overlaps gathered_a");
    if (in_b.overlaps(gathered)) return Status::invalid_argument("ag_gemm: b overlaps gathered_a");
    const char* own_rows = static_cast<const char*>(a.gathered_a) + static_cast<size_t>(impl.topology.local_rank) * rows * a.k * e;
    if (in_a.overlaps(gathered) && a.a != own_rows) {
      return Status::invalid_argument("ag_gemm: a overlaps gathered_a but is not this rank's rows of it (in place, a must be "
                                      "gathered_a + local_rank * M/W * K)");
    }
  }
  return {};
}

Status run_plain(const TpGemmArgs& a, const TpDecision& d, cudaStream_t stream) {
  const size_t bytes = static_cast<size_t>(a.m * a.k) * dtype_size(a.dtype);
  if (a.gathered_a != nullptr && a.gathered_a != a.a) {
    LOOM_CUDA_TRY(cudaMemcpyAsync(a.gathered_a, a.a, bytes, cudaMemcpyDeviceToDevice, stream));
  }
  return gemm(ops::tp::local_gemm(a.a, a.b, a.out, a.m, a), stream, ops::tp::gemm_options_for(d));
}

Status run_decomposed(Communicator& comm, const TpGemmArgs& a, const TpDecision& d, cudaStream_t stream) {
  Communicator::Impl& impl = internal(comm);
  const size_t e = dtype_size(a.dtype);
  void* gathered = a.gathered_a;
  if (gathered == nullptr) {
    LOOM_ASSIGN_OR_RETURN(gathered, ops::family_workspace(impl, ops::tp::kFamily, static_cast<size_t>(a.m * a.k) * e, stream, "ag_gemm"));
  }
  const size_t shard = static_cast<size_t>(a.m / impl.topology.local_world_size * a.k);
  LOOM_TRY_CTX(ops::all_gather_for(comm, a.a, gathered, shard, a.dtype, stream, {}, OpId::kAgGemm,
                                   ops::decomposed_tp_signature(OpId::kAgGemm, a, impl.topology.local_world_size)),
               "ag_gemm (decomposed)");
  return gemm(ops::tp::local_gemm(gathered, a.b, a.out, a.m, a), stream, ops::tp::gemm_options_for(d));
}

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
  const int64_t late = planner::ag_late_claims(ops::tp::tp_request(OpId::kAgGemm, a, world, grid), tile, comm_ctas,
                                               rows_per_flag, world - 1);
  return planner::plan_tail_split(tiles, grid, k_blocks, info.stages, tiles, requested, late);
}

Status run_fused(Communicator& comm, const TpGemmArgs& a, const TpDecision& d, cudaStream_t stream) {
  Communicator::Impl& impl = internal(comm);
  const int world = impl.topology.local_world_size;
  const int me = impl.topology.local_rank;
  const size_t e = dtype_size(a.dtype);
  const int64_t rows = a.m / world;
  const GemmTileInfo info = gemm_tile_info(d.tile);
  // The TP workspace: the gathered A unless the caller gave one, then the piece slots of a tail
  // split (1 KiB aligned).
  const uint64_t row_bytes = static_cast<uint64_t>(a.k) * e;
  const int64_t rows_per_flag = planner::ag_rows_per_flag(rows, row_bytes, d.comm_ctas, world - 1);
  const planner::TailSplit split = ag_tail_split(a, world, d.tile, d.grid, d.comm_ctas, rows_per_flag, d.tail_pieces);
  const int64_t piece_slots = ops::tp::piece_slots_of(split);
  const size_t gathered_bytes = a.gathered_a == nullptr ? (static_cast<size_t>(a.m * a.k) * e + 1023) / 1024 * 1024 : 0;
  const size_t piece_bytes = ops::tp::piece_slot_bytes(piece_slots, d.tile, a.dtype);
  void* workspace = nullptr;
  if (gathered_bytes + piece_bytes > 0) {
    LOOM_ASSIGN_OR_RETURN(workspace, ops::family_workspace(impl, ops::tp::kFamily, gathered_bytes + piece_bytes, stream, "ag_gemm"));
  }
  void* gathered = a.gathered_a != nullptr ? a.gathered_a : workspace;

  kt::AgGemmParams p{};
  const GemmArgs full = ops::tp::local_gemm(gathered, a.b, a.out, a.m, a);
  LOOM_TRY(ops::encode_gemm_operand_maps(full, d.tile, &p.a_gathered, &p.b));
  LOOM_TRY(ops::encode_gemm_rows_map(a.a, rows, a.k, a.k, a.dtype, info.block_m, &p.a_local));
  LOOM_TRY(ops::encode_gemm_output_map(a.out, a.m, a.n, a.n, a.dtype, &p.out));
  p.comm = impl.device_comm();
  LOOM_ASSIGN_OR_RETURN(p.state, ops::family_launch_state(impl, ops::tp::kFamily));
  p.m = static_cast<uint32_t>(a.m);
  p.n = static_cast<uint32_t>(a.n);
  p.k = static_cast<uint32_t>(a.k);

  const int64_t m_blocks = a.m / info.block_m;
  const int64_t n_blocks = (a.n + info.block_n - 1) / info.block_n;
  const int64_t rank_blocks = rows / info.block_m;
  kg::SchedulerParams& s = p.sched;
  s.m_rows = p.m;
  s.m_blocks = static_cast<uint32_t>(m_blocks);
  s.n_blocks = static_cast<uint32_t>(n_blocks);
  s.group_m = ops::tp::group_m_for(d.grid, d.tile, rank_blocks);  // groups never straddle two ranks' rows
  s.m_block_start = static_cast<uint32_t>(me * rank_blocks);       // our rows first: they wait for nothing
  s.queue = &p.state->tile_queue;
  s.row_flags = reinterpret_cast<const uint64_t*>(static_cast<char*>(impl.heap->local_base()) + impl.control.op_flag_offset) +
                world;
  s.rows_per_flag = static_cast<uint32_t>(rows_per_flag);
  s.rows_per_source = static_cast<uint32_t>(rows);
  s.ungated_begin = static_cast<uint32_t>(me * rows);
  s.ungated_end = static_cast<uint32_t>((me + 1) * rows);
  s.k_blocks = static_cast<uint32_t>((a.k + info.block_k - 1) / info.block_k);
  LOOM_TRY(ops::tp::set_tail_split(split, piece_slots > 0 ? static_cast<char*>(workspace) + gathered_bytes : nullptr,
                                    d.tile, a.dtype, world + a.m / rows_per_flag /* after the rows flags */, &s, &p.pieces));
  kg::EpilogueParams& epi = p.epi;
  epi.op = static_cast<uint32_t>(kg::EpilogueOp::kStore);
  epi.out_dtype = static_cast<uint32_t>(a.dtype);
  epi.num_dst = 1;

  p.shard = static_cast<const char*>(a.a);
  p.gathered_offset = impl.heap->offset_of(gathered);
  p.row_bytes = row_bytes;
  p.rows_per_rank = static_cast<uint32_t>(rows);
  p.rows_per_flag = static_cast<uint32_t>(rows_per_flag);
  p.comm_ctas = static_cast<uint32_t>(d.comm_ctas);
  const char* own_rows = static_cast<const char*>(gathered) + static_cast<size_t>(me) * rows * a.k * e;
  p.copy_local = a.gathered_a != nullptr && a.a != own_rows ? 1u : 0u;
  p.timeline = d.timeline;
  // The gathered A's heap offset is part of the plan: peers push into it by their own offset.
  p.signature = ops::tp::plan_signature(OpId::kAgGemm, d.tile, world,
                                        {a.m, a.k, rows_per_flag, static_cast<int64_t>(a.dtype),
                                         static_cast<int64_t>(p.gathered_offset)});

  LOOM_DEBUG("ag_gemm fused %s: tile %s, %d CTAs (%d communicate first), %lld rows per flag, last %lld tiles in %d K "
             "pieces, plan from %s",
             ops::tp::shape_text(a, world).c_str(), std::string(gemm_tile_name(d.tile)).c_str(), d.grid, d.comm_ctas,
             static_cast<long long>(rows_per_flag), static_cast<long long>(piece_slots > 0 ? split.tiles : 0),
             piece_slots > 0 ? split.pieces : 1, d.plan.source.c_str());
  return ops::tp::dispatch_fused(d.tile, a.dtype, a.b_layout, [&]<class Cfg, bool kBF16, bool kBNMajor>() -> Status {
    return ops::launch_kernel(&kt::ag_gemm_kernel<Cfg, kBF16, kBNMajor>, static_cast<unsigned>(d.grid), Cfg::kThreads,
                              Cfg::kSmemBytes, stream, p);
  });
}


Status ag_gemm_one_node(Communicator& comm, const TpGemmArgs& args, cudaStream_t stream, const TpGemmOptions& options) {
  Communicator::Impl& impl = internal(comm);
  LOOM_TRY(ops::tp::check_common(impl, OpId::kAgGemm, args));
  const int world = impl.topology.local_world_size;
  auto fused_check = [&](GemmTile tile, int grid) -> std::string {
    if (options.comm_ctas == 0) return "comm_ctas = 0: the fused ag_gemm needs a communication CTA to push the shard";
    if (grid < 2) return "the GPU has fewer than 2 SMs";
    // At most: the finest chunks (every CTA but one pushing to one destination), and the last
    // wave of tiles split into the most pieces a plan can ask for.
    const int64_t rows = args.m / world;
    const int64_t rows_per_flag = planner::ag_rows_per_flag(rows, static_cast<uint64_t>(args.k) * dtype_size(args.dtype), grid - 1, 1);
    const int most_pieces = std::max(options.tail_pieces, planner::TpCostModel{}.max_tail_pieces);
    const int64_t flags = args.m / rows_per_flag + static_cast<int64_t>(grid) * (most_pieces - 1);
    return ops::tp::check_flag_capacity(impl, static_cast<uint64_t>(flags));
  };
  LOOM_ASSIGN_OR_RETURN(TpDecision d, ops::tp::decide(impl, OpId::kAgGemm, args, options, fused_check));
  LOOM_TRY(check_buffers(impl, args));
  switch (d.path) {
    case TpPath::kPlainGemm: return run_plain(args, d, stream);
    case TpPath::kDecomposed: return run_decomposed(comm, args, d, stream);
    case TpPath::kFused:
      d.comm_ctas = std::clamp(d.plan.comm_ctas, 1, d.grid - 1);
      return run_fused(comm, args, d, stream);
  }
  return Status::internal("ag_gemm: no path");
}

}  // namespace

Status ag_gemm(Communicator& comm, const TpGemmArgs& args, cudaStream_t stream, const TpGemmOptions& options) {
  const Status queued = comm.num_nodes() > 1 ? ops::ag_gemm_multinode(comm, args, stream, options)  // ops/multinode.h
                                             : ag_gemm_one_node(comm, args, stream, options);
  return ops::noted(comm, queued, stream);
}

}  // namespace loom
