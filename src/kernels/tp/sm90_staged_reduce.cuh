// The fused GEMM + ReduceScatter and GEMM + AllReduce kernels, one persistent kernel each (the
// same body; gemm_ar broadcasts): partial tiles staged in the owner's memory and folded into the
// owner's accumulators.
//   gemm_rs  out[M/W, N] = ReduceScatter_rows(a_r[M, K_r] @ b_r)
//   gemm_ar  out[M, N]   = AllReduce(a_r[M, K_r] @ b_r): each owner also stores its reduced tiles
//            into every rank's out (symmetric; one TMA store per rank from the same staged box)
//            and sets final[tile] on every peer; the launch ends when this rank has seen every
//            final tile of the other owners, so out is complete and bit-identical on all ranks
//            (each element is rounded once, by its owner).
// Roles: every CTA computes (TpRole::kCompute). The partial tiles owed to other ranks leave from
// the compute epilogues (TMA stores into the owner's staging) at the rate tiles finish, so no CTA
// is set aside to move data; the sums happen where the owner's accumulators already are.
//
// Rank r computes its whole partial product P_r = a_r @ b_r (all M rows). Rows
// [d*M/W, (d+1)*M/W) belong to rank d. Tile order (TpTiles' rank-banded order, offset 1):
// band by band, the other ranks' rows first (r+1, r+2, ...) and its own last, so what it owes
// leaves early and what it is owed has arrived when its own tiles come.
//   tile owned by d != r   epilogue: TMA-store the rounded 16-bit partial into d's staging slot
//                          for r, then (deferred to the next tile, when the writes have landed)
//                          partial[slot(r, d)][t] = e on d
//   own tile (kTileFold)   before the last kStages k-blocks the producer waits for partial[*][t]
//                          from every peer and loads the W-1 staged partials through the stage
//                          ring; the consumers add them to the fp32 accumulators in rank order
//                          (TileFold::fold_partials (gemm/fold.cuh): acc = ((a + p_s1) + p_s2) + ..., a the
//                          accumulator so far), the last k-blocks follow, the epilogue
//                          rounds once and stores: gemm_rs into out [M/W, N];
//                          gemm_ar into every rank's out [M, N] (one TMA store per rank), then
//                          final[tile] = e on every peer
//   gemm_ar end            every CTA waits for its share of the final[] flags of tiles owned by
//                          others, so the launch ends with the whole of out in place.
//   tail split             the last partial wave of whole tiles would leave SMs idle for a tile's
//                          time: its tiles (own tiles, the order's last) are cut into `pieces` K
//                          ranges (gemm/tail_split.cuh). Pieces (kTilePiece) TMA-store their rounded
//                          16-bit partial into this rank's piece slots and set piece[slot] = e
//                          right after their epilogue; the tile's fold item (K range 0, claimed
//                          after its pieces) adds them after the other ranks' partials.
// Before a CTA's first write into a peer it waits for the peer's entry (fused_frame.cuh).
//
// Buffers (heap offsets equal on all ranks; element = the input type, bf16 or fp16):
//   staging   [(W-1) * M/W, N] in the TP workspace: slot(s, d) = (s - d - 1) mod W holds rank s's
//             partial of d's rows, rows [slot * M/W, (slot+1) * M/W)
//   out       gemm_rs: [M/W, N] local; gemm_ar: [M, N] symmetric
//   pieces    [split.tiles * (split.pieces - 1) * BM, BN] in the TP workspace after the staging (local
//             only): slot q * (pieces - 1) + i holds piece i + 1 of the q-th split tile
// Flags (op_flags of the owner, after the W entry words), own_tiles = (M/W/BM) * n_blocks:
//   partial[slot][t]   W + slot * own_tiles + t, t = (m_block - d*M/W/BM) * n_blocks + n_block
//   final[tile]        W + (W-1) * own_tiles + m_block * n_blocks + n_block        (gemm_ar)
//   piece[slot]        pieces.flag_base + slot (after the final flags; tail_pieces.cuh)
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/common/sm90.cuh"
#include "kernels/gemm/compute_role.cuh"
#include "kernels/gemm/params.h"
#include "kernels/gemm/tail_split.cuh"
#include "kernels/tp/flags.h"
#include "kernels/tp/peer_stores.cuh"
#include "kernels/tp/fused_frame.cuh"
#include "kernels/tp/tail_pieces.cuh"
#include "kernels/tp/tp_scheduler.cuh"

namespace loom::kernels::tp {

struct ReduceGemmParams {
  sm90::TmaDescriptor a;       // [M, K_r]
  sm90::TmaDescriptor b;
  sm90::TmaDescriptor staged;  // this rank's staging [(W-1) * M/W, N], box {64, BLOCK_M}: fold loads
  sm90::TmaDescriptor out[TpTunables::kMaxLocalWorld];       // gemm_rs: [0] = out [M/W, N];
                                                             // gemm_ar: [d] = rank d's out [M, N]; box {64, 16}
  sm90::TmaDescriptor stage_to[TpTunables::kMaxLocalWorld];  // [d] = rank d's staging (d != me), box {64, 16}
  TailPieces pieces;            // this rank's piece slots (tail split)
  DeviceComm comm;
  LaunchState* state;
  uint32_t m, n, k;
  gemm::SchedulerParams sched;  // queue
  TpSchedulerParams tiles;      // rank-banded order (offset 1), fold range = our tile rows
  gemm::TailSplitParams split;
  uint32_t rows_per_rank;       // M / W, a multiple of BLOCK_M
  uint32_t m_blocks_per_rank;
  uint32_t n_blocks;
  uint32_t out_dtype;           // loom::DType of out and the staging (= the input type)
  uint32_t signature;           // plan signature (fused_frame.cuh)
  TileTimelineRecord* timeline;  // optional (diagnostics), one record per tile
};
static_assert(sizeof(ReduceGemmParams) <= 4096, "the reduce kernels' parameters must fit the classic 4 KiB limit");

// Peers enter through the TP flag space (ReduceEpilogueBase).
__device__ __forceinline__ EntryWords entry_words_of(const ReduceGemmParams& p) { return tp_entry(p.comm); }

// Slot of rank `src`'s partial in rank `owner`'s staging (and in its partial flags).
__device__ __forceinline__ uint32_t staging_slot(uint32_t src, uint32_t owner, uint32_t world) {
  return (src + world - owner - 1) % world;
}

__device__ __forceinline__ uint64_t partial_flag_index(const ReduceGemmParams& p, uint32_t slot, uint32_t local_tile) {
  const uint64_t own_tiles = static_cast<uint64_t>(p.m_blocks_per_rank) * p.n_blocks;
  return static_cast<uint64_t>(p.comm.local_world) + slot * own_tiles + local_tile;
}

__device__ __forceinline__ uint64_t final_flag_index(const ReduceGemmParams& p, uint32_t tile) {
  const uint64_t own_tiles = static_cast<uint64_t>(p.m_blocks_per_rank) * p.n_blocks;
  return static_cast<uint64_t>(p.comm.local_world) + static_cast<uint64_t>(p.comm.local_world - 1) * own_tiles + tile;
}

// The compute role's epilogue policy (see TileEpilogue for the interface): routes each staged
// box by the rank that owns its rows and signals that rank per tile.
template <int kBlockM, int kBlockN, bool kBroadcast>
class ReduceEpilogue : public ReduceEpilogueBase<ReduceGemmParams> {
 public:
  using ReduceEpilogueBase::ReduceEpilogueBase;

  __device__ void prefetch() const {
    const int world = p_.comm.local_world;
    if constexpr (kBroadcast) {
      for (int d = 0; d < world; ++d) sm90::prefetch_tensormap(&p_.out[d]);
    } else {
      sm90::prefetch_tensormap(&p_.out[0]);
    }
    for (int d = 0; d < world; ++d) {
      if (d != p_.comm.local_rank) sm90::prefetch_tensormap(&p_.stage_to[d]);
    }
    if (p_.split.pieces >= 2) sm90::prefetch_tensormap(&p_.pieces.store);
  }

  // Lane 0 of a consumer warp: the 16 x 64 box of `tile` whose top-left element is (row, col).
  __device__ void issue(const void* box, const gemm::WorkItem& tile, uint32_t row, uint32_t col) const {
    if (tile.kind == static_cast<uint32_t>(gemm::WorkKind::kTilePiece)) {
      p_.pieces.store_box<kBlockM, kBlockN>(box, tile, row, col);
      return;
    }
    const uint32_t me = static_cast<uint32_t>(p_.comm.local_rank);
    const uint32_t world = static_cast<uint32_t>(p_.comm.local_world);
    const uint32_t owner = row / p_.rows_per_rank;
    const uint32_t row_in_owner = row - owner * p_.rows_per_rank;
    if (owner == me) {
      if constexpr (kBroadcast) {
        for (uint32_t i = 0; i < world; ++i) {
          const uint32_t d = (me + i) % world;  // ours first, then the peers
          if (d != me && !entered(d)) continue;
          tma_store_2d(&p_.out[d], col, row, box);
        }
      } else {
        tma_store_2d(&p_.out[0], col, row_in_owner, box);
      }
      return;
    }
    if (!entered(owner)) return;  // failure recorded; the launch is aborting
    const uint32_t slot = staging_slot(me, owner, world);
    tma_store_2d(&p_.stage_to[owner], col, slot * p_.rows_per_rank + row_in_owner, box);
  }

  // One thread (the compute role's signaler), once every box of `tile` has landed.
  __device__ void signal(const gemm::WorkItem& tile, uint32_t /*m_blocks*/, uint32_t n_blocks) const {
    // A failed entry wait (any warp) skipped a box and raised the device abort before the
    // consumers' barrier that precedes this call: signal nothing then. Only the device word is
    // read here (the host-mapped one would cost a PCIe round trip per tile).
    if (*reinterpret_cast<const volatile uint32_t*>(ctx_.params.device_abort) != 0) return;
    const DeviceComm& c = p_.comm;
    const uint32_t me = static_cast<uint32_t>(c.local_rank);
    const uint32_t world = static_cast<uint32_t>(c.local_world);
    if (tile.kind == static_cast<uint32_t>(gemm::WorkKind::kTilePiece)) {
      p_.pieces.signal(c, tile, epoch_);
      return;
    }
    const uint32_t owner = tile.m_block / p_.m_blocks_per_rank;
    if (owner != me) {
      const uint32_t local_tile = (tile.m_block - owner * p_.m_blocks_per_rank) * n_blocks + tile.n_block;
      __threadfence_system();
      flag_store_release(op_flag(c, static_cast<int>(owner), partial_flag_index(p_, staging_slot(me, owner, world), local_tile)),
                         epoch_);
      return;
    }
    if constexpr (kBroadcast) {
      __threadfence_system();
      for (uint32_t d = 0; d < world; ++d) {
        if (d != me) flag_store_release(op_flag(c, static_cast<int>(d), final_flag_index(p_, tile.tile)), epoch_);
      }
    }
  }
};

// The compute role's Fold policy (ComputeRole explains the interface): partials of own tiles.
template <int kBlockM>
class StagedFold {
 public:
  static constexpr bool kEnabled = true;

  __device__ StagedFold(const ReduceGemmParams& p, uint64_t epoch) : p_(p), epoch_(epoch) {}

  __device__ uint32_t world() const { return static_cast<uint32_t>(p_.comm.local_world); }
  __device__ uint32_t self() const { return static_cast<uint32_t>(p_.comm.local_rank); }
  __device__ const sm90::TmaDescriptor* map() const { return &p_.staged; }
  __device__ const sm90::TmaDescriptor* piece_map() const { return &p_.pieces.load; }

  __device__ int32_t source_row(const gemm::WorkItem& tile, uint32_t source) const {
    const uint32_t me = self();
    const uint32_t row_in_owner = (tile.m_block - me * p_.m_blocks_per_rank) * kBlockM;
    return static_cast<int32_t>(staging_slot(source, me, world()) * p_.rows_per_rank + row_in_owner);
  }

  // Producer thread: every peer's partial of `tile`, and every piece of a split tile, is staged
  // here (bounded waits).
  __device__ bool wait_sources(const gemm::WorkItem& tile, const WaitContext& ctx) const {
    const DeviceComm& c = p_.comm;
    const uint32_t me = self();
    const uint32_t local_tile = (tile.m_block - me * p_.m_blocks_per_rank) * p_.n_blocks + tile.n_block;
    for (uint32_t s = 0; s < world(); ++s) {
      if (s == me) continue;
      const uint64_t index = partial_flag_index(p_, staging_slot(s, me, world()), local_tile);
      if (!wait_flag(op_flag(c, static_cast<int>(me), index), epoch_, ctx, static_cast<int>(s), kPartialFlag,
                     local_tile)) {
        return false;
      }
    }
    if (!p_.pieces.wait(c, tile, epoch_, ctx)) return false;
    // Peers wrote the staging (generic-proxy flags after async-proxy data); TMA reads it next.
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
    return true;
  }

 private:
  const ReduceGemmParams& p_;
  uint64_t epoch_;
};

// gemm_ar's end (thread 0): this CTA's share of the final tiles owned by other ranks.
__device__ __forceinline__ bool wait_final_tiles(const ReduceGemmParams& p, uint64_t epoch, const WaitContext& ctx) {
  const DeviceComm& c = p.comm;
  const uint32_t me = static_cast<uint32_t>(c.local_rank);
  const uint32_t others = (p.sched.m_blocks - p.m_blocks_per_rank) * p.n_blocks;
  for (uint32_t i = blockIdx.x; i < others; i += gridDim.x) {
    const uint32_t row_index = i / p.n_blocks;
    const uint32_t n_block = i - row_index * p.n_blocks;
    const uint32_t m_block = row_index < me * p.m_blocks_per_rank ? row_index : row_index + p.m_blocks_per_rank;
    const uint32_t tile = m_block * p.n_blocks + n_block;
    const int owner = static_cast<int>(m_block / p.m_blocks_per_rank);
    if (!wait_flag(op_flag(c, static_cast<int>(me), final_flag_index(p, tile)), epoch, ctx, owner, kFinalFlag, tile)) {
      return false;
    }
  }
  return true;
}

// Both operators' kernel (kBroadcast: gemm_ar): every CTA computes (there is no separate
// communication role: the partial and final tiles leave from the epilogues, at the rate tiles
// finish).
template <class Cfg, bool kBF16, bool kBNMajor, bool kBroadcast>
__global__ void __launch_bounds__(Cfg::kThreads, 1) gemm_reduce_kernel(const __grid_constant__ ReduceGemmParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  using Scheduler = TpScheduler<Cfg::kBlockM>;
  using Epilogue = ReduceEpilogue<Cfg::kBlockM, Cfg::kBlockN, kBroadcast>;
  using Fold = StagedFold<Cfg::kBlockM>;
  using Role = gemm::ComputeRole<Cfg, kBF16, kBNMajor, Scheduler, Epilogue, Cfg::kSetMaxNReg, Fold>;
  const DeviceComm& c = p.comm;
  const frame::LaunchFrame f =
      frame::LaunchFrame::enter(c, kBroadcast ? OpId::kGemmAr : OpId::kGemmRs, tp_entry(c), p.signature);
  const uint64_t epoch = f.epoch;
  const WaitContext& ctx = f.ctx;
  Role::init(smem);

  const TpRoleTable roles;  // every CTA computes
  Scheduler sched(p.sched, TpTiles<Cfg::kBlockM>(p.tiles, epoch), gemm::TailSplit(p.split));
  Epilogue epi(p, epoch, ctx);
  const Fold fold(p, epoch);
  const gemm::GemmOperands ops{&p.a, &p.b, p.m, p.n, p.k, nullptr, 0, 0, p.timeline};
  const gemm::WorkItem exit =
      Role::run(smem, ops, sched, epi, roles.rest_index(blockIdx.x, gridDim.x), gridDim.x, ctx, fold);
  if constexpr (kBroadcast) {
    if (threadIdx.x == 0 && exit.kind == static_cast<uint32_t>(gemm::WorkKind::kDone)) (void)wait_final_tiles(p, epoch, ctx);
  }
  f.finish(p.state, c);
}

}  // namespace loom::kernels::tp
