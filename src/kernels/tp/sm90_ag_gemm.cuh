// Fused AllGather + GEMM: out[M, N] = AllGather_rows(a_r[M/W, K]) @ b_r, one persistent kernel.
//
// Roles (TpRoleTable): CTAs [0, comm_ctas) communicate first, then compute; the rest compute.
//   communication  one thread per CTA pushes this rank's shard into every peer's gathered A with
//                  TMA bulk copies (the bulk-copy stream), row chunk by row chunk, and after each chunk sets
//                  rows[f] = e on that peer. Destinations in the order they need the rows: rank
//                  me-1 computes our rows right after its own, me-2 after that, ... Optionally the
//                  shard is also copied into this rank's own rows of a user-visible gathered A.
//                  When its chunks are done the CTA joins the compute role (run() once).
//   compute        the GEMM engine's ComputeRole; tiles come from the launch's queue in a raster
//                  rotated to start at this rank's rows, which are read straight from the shard
//                  (GemmOperands::a_local), so the first tiles wait for nothing. Every other tile
//                  waits (bounded, TpTiles' gate) for the row-chunk flags it covers.
//                  Tail split (gemm/tail_split.cuh): the last partial wave's tiles run as K pieces
//                  staged in this rank's piece slots (local; piece[slot] = e after each piece's
//                  epilogue) and folded by the tile's fold item (AgPieceFold), which stores out.
//
// Buffers (heap offsets equal on all ranks):
//   gathered A   [M, K] symmetric (user's gathered_a or the TP workspace): rank s's rows
//                [s*M/W, (s+1)*M/W) are written by rank s
//   rows flags   op_flags[W + f], f < M / rows_per_flag: "rows [f*rpf, (f+1)*rpf) have arrived",
//                written by the owner of those rows (f / (M/W/rpf)) into every peer
//   pieces       [split.tiles * (split.pieces - 1) * BM, BN] in the TP workspace (after the gathered A
//                when that lives there), local; flags piece[slot] after the rows flags (tail_pieces.cuh)
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/bulk_copy.cuh"
#include "kernels/common/sm90.cuh"
#include "kernels/gemm/compute_role.cuh"
#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/params.h"
#include "kernels/gemm/tail_split.cuh"
#include "kernels/tp/fused_frame.cuh"
#include "kernels/tp/tail_pieces.cuh"
#include "kernels/tp/tp_scheduler.cuh"

namespace loom::kernels::tp {

struct AgGemmParams {
  sm90::TmaDescriptor a_gathered;  // [M, K] gathered A in this rank's heap, box {64, BLOCK_M}
  sm90::TmaDescriptor a_local;     // [M/W, K] this rank's shard, box {64, BLOCK_M}
  sm90::TmaDescriptor b;
  sm90::TmaDescriptor out;         // [M, N], box {64, 16}
  TailPieces pieces;               // this rank's piece slots (tail split)
  DeviceComm comm;
  LaunchState* state;
  uint32_t m, n, k;
  gemm::SchedulerParams sched;  // queue = the family's tile queue, rotation to our rows
  TpSchedulerParams tiles;      // gate on the rows flags
  gemm::TailSplitParams split;
  gemm::EpilogueParams epi;     // one destination (out), no signals
  const char* shard;            // this rank's rows (device memory of this GPU)
  uint64_t gathered_offset;     // heap offset of the gathered A
  uint64_t row_bytes;           // K * element size (a multiple of 16)
  uint32_t rows_per_rank;       // M / W, a multiple of BLOCK_M
  uint32_t rows_per_flag;       // divides rows_per_rank (planner::ag_rows_per_flag); a tile row may need several
  uint32_t comm_ctas;
  uint32_t copy_local;          // 1: also copy the shard into our own rows of the gathered A
  uint32_t signature;           // plan signature (fused_frame.cuh)
  TileTimelineRecord* timeline;  // optional (diagnostics), one record per tile
};
static_assert(sizeof(AgGemmParams) <= 4096, "ag_gemm's parameters must fit the classic 4 KiB limit");

// What one communication CTA copies: every comm_ctas-th position of the list
//   position i -> destination slot d = i / chunks, chunk f = i % chunks (chunks = M/W/rpf)
//   slot d < W-1: rank (me - 1 - d) mod W, with flag rows[me*chunks + f] on it
//   slot W-1 (only with copy_local): this rank's own gathered rows, no flag
struct AgPushList {
  const AgGemmParams* p;
  uint32_t comm_index;

  using Item = BulkItem;

  __device__ uint32_t chunks() const { return p->rows_per_rank / p->rows_per_flag; }
  __device__ uint32_t positions() const {
    const uint32_t slots = static_cast<uint32_t>(p->comm.local_world - 1) + (p->copy_local != 0 ? 1u : 0u);
    return slots * chunks();
  }
  __device__ uint32_t count() const {
    const uint32_t n = positions();
    return comm_index < n ? (n - comm_index + p->comm_ctas - 1) / p->comm_ctas : 0;
  }
  __device__ Item item(uint32_t k) const {
    const DeviceComm& c = p->comm;
    const uint32_t per = chunks();
    const uint32_t i = comm_index + k * p->comm_ctas;
    const uint32_t slot = i / per;
    const uint32_t f = i - slot * per;
    const int world = c.local_world;
    const int me = c.local_rank;
    const int rank = slot < static_cast<uint32_t>(world - 1) ? (me - 1 - static_cast<int>(slot) + 2 * world) % world : me;
    const uint64_t chunk_bytes = static_cast<uint64_t>(p->rows_per_flag) * p->row_bytes;
    const uint64_t first_row = static_cast<uint64_t>(me) * p->rows_per_rank + static_cast<uint64_t>(f) * p->rows_per_flag;
    Item it;
    it.src = p->shard + f * chunk_bytes;
    it.dst = reinterpret_cast<char*>(c.peer_heap_bases[rank]) + p->gathered_offset + first_row * p->row_bytes;
    it.bytes = chunk_bytes;
    it.flag = rank != me ? op_flag(c, rank, static_cast<uint64_t>(world) + static_cast<uint64_t>(me) * per + f) : nullptr;
    it.rank = rank;
    return it;
  }
  __device__ uint32_t pieces(uint32_t k) const {
    const uint64_t bytes = static_cast<uint64_t>(p->rows_per_flag) * p->row_bytes;
    return static_cast<uint32_t>((bytes + TpTunables::kCopyStageBytes - 1) / TpTunables::kCopyStageBytes);
  }
};

// The compute role's epilogue: out through the GEMM engine's TileEpilogue, the pieces of split
// tiles into this rank's piece slots (and their flags, from the signaler).
template <int kBlockM, int kBlockN>
class AgEpilogue {
 public:
  __device__ AgEpilogue(const AgGemmParams& p, uint64_t epoch) : p_(p), out_(p.epi, &p.out), epoch_(epoch) {}

  __device__ uint32_t out_dtype() const { return out_.out_dtype(); }
  __device__ bool signals() const { return p_.split.pieces >= 2; }  // only pieces signal
  __device__ void prefetch() const {
    out_.prefetch();
    if (signals()) sm90::prefetch_tensormap(&p_.pieces.store);
  }
  __device__ void issue(const void* box, const gemm::WorkItem& tile, uint32_t row, uint32_t col) const {
    if (tile.kind != static_cast<uint32_t>(gemm::WorkKind::kTilePiece)) {
      out_.issue(box, tile, row, col);
      return;
    }
    p_.pieces.store_box<kBlockM, kBlockN>(box, tile, row, col);
  }
  __device__ void signal(const gemm::WorkItem& tile, uint32_t /*m_blocks*/, uint32_t /*n_blocks*/) const {
    if (tile.kind == static_cast<uint32_t>(gemm::WorkKind::kTilePiece)) p_.pieces.signal(p_.comm, tile, epoch_);
  }

 private:
  const AgGemmParams& p_;
  gemm::TileEpilogue<kBlockM> out_;
  uint64_t epoch_;
};

// The compute role's Fold policy: only the pieces of split tiles (no other rank's partials).
struct AgPieceFold {
  static constexpr bool kEnabled = true;
  __device__ AgPieceFold(const AgGemmParams& p, uint64_t epoch) : p_(p), epoch_(epoch) {}
  __device__ uint32_t world() const { return 1; }  // no other rank's partial is folded
  __device__ uint32_t self() const { return 0; }
  __device__ const sm90::TmaDescriptor* map() const { return &p_.pieces.load; }
  __device__ const sm90::TmaDescriptor* piece_map() const { return &p_.pieces.load; }
  __device__ int32_t source_row(const gemm::WorkItem& /*tile*/, uint32_t /*source*/) const { return 0; }  // none
  // Producer thread: every piece of the split tile is staged (bounded waits).
  __device__ bool wait_sources(const gemm::WorkItem& tile, const WaitContext& ctx) const {
    if (!p_.pieces.wait(p_.comm, tile, epoch_, ctx)) return false;
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);  // TMA reads the pieces next
    return true;
  }

 private:
  const AgGemmParams& p_;
  uint64_t epoch_;
};

using AgPushStream = BulkCopyStream<TpTunables::kCopyStages, TpTunables::kCopyStageBytes>;

// The communication role of one CTA (all threads call): pushes its items of the shard, each
// destination entered first; returns, on every thread, whether the CTA may go on to compute.
template <class Cfg>
__device__ bool ag_push_shard(uint8_t* smem_raw, const AgGemmParams& p, uint32_t comm_index, uint64_t epoch,
                              const WaitContext& ctx) {
  return frame::run_data_role<AgPushStream, Cfg::kEpiOffset>(smem_raw, [&](AgPushStream& stream) {
    const AgPushList list{&p, comm_index};
    const DeviceComm& c = p.comm;
    auto enter = [&](int rank) {
      return rank == c.local_rank || wait_entry(c, tp_entry(c), rank, epoch, p.signature, ctx);
    };
    return stream.push<TpTunables::kPushFlagLag>(list, epoch, ctx, enter);
  });
}

template <class Cfg, bool kBF16, bool kBNMajor>
__global__ void __launch_bounds__(Cfg::kThreads, 1) ag_gemm_kernel(const __grid_constant__ AgGemmParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  using Scheduler = TpScheduler<Cfg::kBlockM>;
  using Epilogue = AgEpilogue<Cfg::kBlockM, Cfg::kBlockN>;
  using Role = gemm::ComputeRole<Cfg, kBF16, kBNMajor, Scheduler, Epilogue, Cfg::kSetMaxNReg, AgPieceFold>;
  const DeviceComm& c = p.comm;
  const frame::LaunchFrame f = frame::LaunchFrame::enter(c, OpId::kAgGemm, tp_entry(c), p.signature);
  const uint64_t epoch = f.epoch;
  const WaitContext& ctx = f.ctx;
  Role::init(smem);

  TpRoleTable roles;
  roles.set(TpRole::kCommunication, p.comm_ctas);
  bool compute = true;
  if (roles.role_of(blockIdx.x) == TpRole::kCommunication) {
    compute = ag_push_shard<Cfg>(smem, p, roles.index_in_role(blockIdx.x), epoch, ctx);
  }
  if (compute) {
    Scheduler sched(p.sched, TpTiles<Cfg::kBlockM>(p.tiles, epoch), gemm::TailSplit(p.split));
    Epilogue epi(p, epoch);
    const AgPieceFold fold(p, epoch);
    const uint32_t own_begin = static_cast<uint32_t>(c.local_rank) * p.rows_per_rank;
    const gemm::GemmOperands ops{&p.a_gathered, &p.b,    p.m,       p.n,
                                 p.k,           &p.a_local, own_begin, own_begin + p.rows_per_rank,
                                 p.timeline};
    (void)Role::run(smem, ops, sched, epi, roles.rest_index(blockIdx.x, gridDim.x), gridDim.x, ctx, fold);
  }
  f.finish(p.state, c);
}

}  // namespace loom::kernels::tp
