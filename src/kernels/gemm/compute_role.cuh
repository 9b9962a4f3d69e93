// The GEMM engine's compute role: one persistent CTA's share of D = A * B, callable from any
// kernel (the standalone GEMM kernel, or a fused kernel whose role table makes this CTA a
// compute CTA).
//
// Roles inside the CTA (Cfg::kThreads threads):
//   warpgroup 0            producer: thread 0 asks the scheduler for tiles (the scheduler gates
//                          each tile on its arrival flags), publishes them in the tile ring and
//                          issues the TMA loads of A and B into the kStages-deep ring of stages.
//                          Thread 32 is the signaler (when the epilogue signals): it takes
//                          finished tiles from the signal ring and calls Epilogue::signal (system
//                          fence, flag stores into peers: microseconds that would otherwise stall
//                          a consumer warpgroup every tile). Registers drop to kProducerRegs.
//                          The other threads idle.
//   warpgroups 1..C        consumers: read the tile ring, run the wgmma mainloop (warpgroup g
//                          owns tile rows [64g, 64g + 64), m64nBNk16 per 16-wide k step, one
//                          k-block of wgmma in flight while the next stage is waited for), then
//                          the epilogue: each warp stages its 16 rows x 128 bytes at a time
//                          (converted to the output type, 128B-swizzled, double-buffered) and
//                          hands the box to the epilogue object (TMA store or reduce-add). A
//                          tile's signal is posted after the next tile's mainloop (or at the
//                          exit), when the bulk writes have long landed: each warp waits for its
//                          writes and arrives on signal_full. Registers rise to kConsumerRegs.
// Synchronisation: full[s] (1 arrival + TMA bytes), empty[s] (one arrival per consumer warp),
// tile_full[t] (producer), tile_empty[t] (one arrival per consumer warp), signal_full[t] (one
// arrival per consumer warp; the item is written by warpgroup 1's first warp), signal_empty[t]
// (the signaler); every wait is bounded (sm90::mbarrier_wait, comm/wait.cuh's wait_flag for
// gates) and leaves cleanly on failure. The consumers end the signaler with the exit item.
//
// Use from a kernel launched with Cfg::kThreads threads, __launch_bounds__(Cfg::kThreads, 1) and
// Cfg::kSmemBytes of dynamic shared memory:
//   Role::init(smem);                                           // every thread, once per launch
//   WorkItem exit = Role::run(smem, operands, sched, epi, index, count, ctx);  // every thread
// run() returns (to every thread, after a CTA barrier) the item that ended it: kDone, kFailed,
// or kYield, after which the caller may run another role and call run() again (the pipeline
// state persists in shared memory; the scheduler object must be the same).
//
// Fold (fused reduce-scatter): a kTileFold item also adds partial tiles that other ranks staged
// for this tile, in rank order, into its fp32 accumulators, which the epilogue rounds once. The
// partials sit in the stage ring before the tile's last kStages k-blocks (fold_position): there
// the producer waits for them (Fold::wait_sources) and loads them (one 64-column x BLOCK_M box
// per stage, into the A buffer, 128B-swizzled like the epilogue's boxes); the consumers drain
// their wgmma, each thread adds exactly the elements its accumulators hold (conflict-free, the
// epilogue's addressing), and the remaining k-blocks accumulate on top. A Fold policy:
//   static constexpr bool kEnabled;                                  // false: NoFold
//   uint32_t world() const; uint32_t self() const;                   // ranks, this rank
//   const sm90::TmaDescriptor* map() const;   // staged partials: input element type, box {64, BLOCK_M}
//   int32_t source_row(const WorkItem& tile, uint32_t source) const; // map row of the tile's row 0
//   bool wait_sources(const WorkItem& tile, const WaitContext&) const;  // producer thread, bounded:
//                                                    // the other ranks' partials and the tile's pieces
// Tail split (SchedulerParams): a kTilePiece item computes part of a tile's K range and stages
// its partial through the epilogue like any tile; the tile's kTileFold item (which computes K
// range 0) then also adds its item.split_count pieces, after the other ranks' partials, from
//   const sm90::TmaDescriptor* piece_map() const;    // pieces [slots * BLOCK_M, BLOCK_N], box {64, BLOCK_M}
// (a Fold policy without piece_map() folds no pieces; its scheduler must not split).
#pragma once

#include <cuda/ptx>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/comm/wait.cuh"
#include "kernels/common/sm90.cuh"
#include "kernels/gemm/config.h"
#include "kernels/gemm/params.h"
#include "loom/diagnostics.h"

namespace loom::kernels::gemm {

// The A and B operands as the role sees them: tensor maps (kernel parameters or global memory)
// and the problem shape.
struct GemmOperands {
  const sm90::TmaDescriptor* a;  // [M, K] row-major, box {64, BLOCK_M}, 128B swizzle
  const sm90::TmaDescriptor* b;  // N-major: [K, N], box {64, 64}; K-major: [N, K], box {64, BLOCK_N}
  uint32_t m, n, k;
  // Optional second source of A (a fused AllGather+GEMM reads this rank's own rows where they
  // already are, not from the gathered copy): tiles whose first row r lies in
  // [local_row_begin, local_row_end) load row r - local_row_begin of a_local (same box). The
  // range must be a multiple of BLOCK_M rows so no tile straddles it.
  const sm90::TmaDescriptor* a_local = nullptr;
  uint32_t local_row_begin = 0;
  uint32_t local_row_end = 0;
  // Optional per-tile timeline (diagnostics; loom/diagnostics.h), indexed by WorkItem::tile.
  TileTimelineRecord* timeline = nullptr;
};

// The Fold policy of roles that fold nothing (every standalone GEMM).
struct NoFold {
  static constexpr bool kEnabled = false;
};

// Per-call pipeline state kept in shared memory between run() calls.
struct RoleState {
  uint32_t producer_stage, producer_phase, producer_slot, producer_slot_phase;
  uint32_t consumer_stage, consumer_phase, consumer_slot, consumer_slot_phase;
  WorkItem exit;
  uint32_t epi_parity;
  uint32_t signal_post;  // consumers' next signal slot | phase << 16
  uint32_t signal_take;  // the signaler's next signal slot | phase << 16
};
static_assert(sizeof(RoleState) <= kRoleStateBytes, "RoleState must fit its kRoleStateBytes slot");

// A ring item written by another thread of the CTA (the ring's mbarrier ordered it).
__device__ __forceinline__ WorkItem load_item(const WorkItem* slot) {
  const volatile WorkItem* v = slot;
  WorkItem w;
  w.kind = v->kind;
  w.m_block = v->m_block;
  w.n_block = v->n_block;
  w.tile = v->tile;
  w.k_begin = v->k_begin;
  w.k_end = v->k_end;
  w.split_slot = v->split_slot;
  w.split_count = v->split_count;
  return w;
}

// A tile's k-block range: [begin, end).
struct KRange {
  uint32_t begin, end;
};
__device__ __forceinline__ KRange k_range_of(const WorkItem& item, uint32_t k_blocks) {
  return KRange{item.k_begin, min(item.k_end, k_blocks)};
}

// kManageRegisters: run() moves registers from the producer to the consumers (setmaxnreg) on
// entry and back on exit. ptxas (CUDA 13.0) handles that when run() is called once per launch;
// when a kernel calls run() in a loop (role changes) it falls back to spilling the accumulators,
// so such kernels pass false (and use a configuration whose consumers fit the entry budget,
// e.g. 128x128: 121 registers; 128x256 needs the reallocation).
template <class Cfg, bool kBF16, bool kBNMajor, class Scheduler, class Epilogue,
          bool kManageRegisters = Cfg::kSetMaxNReg, class Fold = NoFold>
class ComputeRole {
 public:
  static constexpr int kThreads = Cfg::kThreads;
  static constexpr uint32_t kSmemBytes = Cfg::kSmemBytes;
  static constexpr int BM = Cfg::kBlockM;
  static constexpr int BN = Cfg::kBlockN;
  static constexpr int kStages = Cfg::kStages;
  static constexpr int kAcc = BN / 2;  // fp32 accumulators per consumer thread
  static constexpr int kSignalerThread = 32;  // lane 0 of the producer warpgroup's second warp

  // Every thread of the CTA, once per launch, before the first run().
  __device__ static void init(uint8_t* smem_raw) {
    const Smem sm(smem_raw);
    if (threadIdx.x == 0) {
      for (int s = 0; s < kStages; ++s) {
        cuda::ptx::mbarrier_init(sm.full(s), 1);
        cuda::ptx::mbarrier_init(sm.empty(s), Cfg::kConsumers * 4);
      }
      for (int t = 0; t < kTileSlots; ++t) {
        cuda::ptx::mbarrier_init(sm.tile_full(t), 1);
        cuda::ptx::mbarrier_init(sm.tile_empty(t), Cfg::kConsumers * 4);
        cuda::ptx::mbarrier_init(sm.signal_full(t), Cfg::kConsumers * 4);
        cuda::ptx::mbarrier_init(sm.signal_empty(t), 1);
      }
      RoleState* st = sm.state();
      *st = RoleState{};
      // Make the initialised barriers visible to the async proxy (TMA complete_tx).
      cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
    }
    __syncthreads();
  }

  __device__ static WorkItem run(uint8_t* smem_raw, const GemmOperands& ops, Scheduler& sched, Epilogue& epi,
                                 uint32_t compute_index, uint32_t num_compute, const WaitContext& ctx) {
    static_assert(!Fold::kEnabled, "a role that folds partial tiles must be given its Fold policy");
    return run(smem_raw, ops, sched, epi, compute_index, num_compute, ctx, Fold{});
  }

  __device__ static WorkItem run(uint8_t* smem_raw, const GemmOperands& ops, Scheduler& sched, Epilogue& epi,
                                 uint32_t compute_index, uint32_t num_compute, const WaitContext& ctx,
                                 const Fold& fold) {
    const Smem sm(smem_raw);
    const uint32_t warpgroup = threadIdx.x / 128;
    if (warpgroup == 0) {
      if constexpr (kManageRegisters) sm90::setmaxnreg_dec<Cfg::kProducerRegs>();
      if (threadIdx.x == 0) producer(sm, ops, sched, fold, compute_index, num_compute, ctx);
      if (threadIdx.x == kSignalerThread && epi.signals()) signaler(sm, ops, epi, ctx);
    } else {
      if constexpr (kManageRegisters) sm90::setmaxnreg_inc<Cfg::kConsumerRegs>();
      consumer(sm, ops, epi, fold, warpgroup - 1, ctx);
      if constexpr (kManageRegisters) sm90::setmaxnreg_dec<Cfg::kEntryRegs>();
    }
    // The producer warpgroup takes its registers back only after this barrier: the CTA's pool is
    // exactly the consumers' kConsumerRegs plus the producer's kProducerRegs, so had it done so
    // right after a quick producer loop (a CTA that got no tile), before the consumers' increase
    // was granted, the consumers' setmaxnreg.inc would wait forever (a hang no abort reaches).
    __syncthreads();
    if constexpr (kManageRegisters) {
      if (warpgroup == 0) sm90::setmaxnreg_inc<Cfg::kEntryRegs>();
    }
    const WorkItem exit = sm.state()->exit;
    __syncthreads();  // the next run() may overwrite it
    return exit;
  }

 private:
  struct Smem {
    uint8_t* base;
    __device__ explicit Smem(uint8_t* raw)
        : base(reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023})) {}
    __device__ uint8_t* a(int s) const { return base + Cfg::kAOffset + s * Cfg::kABytes; }
    __device__ uint8_t* b(int s) const { return base + Cfg::kBOffset + s * Cfg::kBBytes; }
    __device__ uint8_t* epi(int g, int w, uint32_t parity) const {
      return base + Cfg::kEpiOffset + ((g * 4 + w) * 2 + parity) * kEpiBoxBytes;
    }
    __device__ uint64_t* full(int s) const { return reinterpret_cast<uint64_t*>(base + Cfg::kFullOffset) + s; }
    __device__ uint64_t* empty(int s) const { return reinterpret_cast<uint64_t*>(base + Cfg::kEmptyOffset) + s; }
    __device__ uint64_t* tile_full(int t) const {
      return reinterpret_cast<uint64_t*>(base + Cfg::kTileFullOffset) + t;
    }
    __device__ uint64_t* tile_empty(int t) const {
      return reinterpret_cast<uint64_t*>(base + Cfg::kTileEmptyOffset) + t;
    }
    __device__ WorkItem* ring(int t) const { return reinterpret_cast<WorkItem*>(base + Cfg::kTileRingOffset) + t; }
    __device__ uint64_t* signal_full(int t) const {
      return reinterpret_cast<uint64_t*>(base + Cfg::kSignalFullOffset) + t;
    }
    __device__ uint64_t* signal_empty(int t) const {
      return reinterpret_cast<uint64_t*>(base + Cfg::kSignalEmptyOffset) + t;
    }
    __device__ WorkItem* signal_ring(int t) const {
      return reinterpret_cast<WorkItem*>(base + Cfg::kSignalRingOffset) + t;
    }
    __device__ RoleState* state() const { return reinterpret_cast<RoleState*>(base + Cfg::kStateOffset); }
  };

  // ---- producer (one thread) -----------------------------------------------------------------
  __device__ static void producer(const Smem& sm, const GemmOperands& ops, Scheduler& sched, const Fold& fold,
                                  uint32_t compute_index, uint32_t num_compute, const WaitContext& ctx) {
    RoleState* st = sm.state();
    uint32_t stage = st->producer_stage, phase = st->producer_phase;
    uint32_t slot = st->producer_slot, slot_phase = st->producer_slot_phase;
    sm90::prefetch_tensormap(ops.a);
    sm90::prefetch_tensormap(ops.b);
    if (ops.a_local != nullptr) sm90::prefetch_tensormap(ops.a_local);
    if constexpr (Fold::kEnabled) sm90::prefetch_tensormap(fold.map());
    const uint32_t k_blocks = (ops.k + kBlockK - 1) / kBlockK;

    for (;;) {
      const WorkItem item = sched.next(compute_index, num_compute, ctx);
      // Publish the item (tiles, and the sentinel that tells the consumers to leave).
      if (!sm90::mbarrier_wait(sm.tile_empty(slot), slot_phase ^ 1, ctx,
                               sm90::barrier_what(sm90::BarrierWhat::kTileEmpty, slot))) {
        return;  // consumers leave on the abort this raised
      }
      *sm.ring(slot) = item;
      cuda::ptx::mbarrier_arrive(sm.tile_full(slot));
      if (++slot == kTileSlots) {
        slot = 0;
        slot_phase ^= 1;
      }
      if (!is_tile_kind(item.kind)) break;
      if (ops.timeline != nullptr && record_index(ops, item) != kNoRecord) {
        record_claim(ops.timeline[record_index(ops, item)], item);
      }

      const int32_t m0 = static_cast<int32_t>(item.m_block * BM);
      const int32_t n0 = static_cast<int32_t>(item.n_block * BN);
      const sm90::TmaDescriptor* a_map = ops.a;
      int32_t a_row = m0;
      if (ops.a_local != nullptr && static_cast<uint32_t>(m0) >= ops.local_row_begin &&
          static_cast<uint32_t>(m0) < ops.local_row_end) {
        a_map = ops.a_local;
        a_row = m0 - static_cast<int32_t>(ops.local_row_begin);
      }
      // One k-block: wait for a free stage, then its A and B loads.
      auto load_k_block = [&](uint32_t kb) -> bool {
        if (!sm90::mbarrier_wait(sm.empty(stage), phase ^ 1, ctx,
                                 sm90::barrier_what(sm90::BarrierWhat::kStageEmpty, stage))) {
          return false;
        }
        uint64_t* full = sm.full(stage);
        constexpr uint32_t kStageTxBytes = Cfg::kStageTxBytes;
        cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                             full, kStageTxBytes);
        const int32_t k0 = static_cast<int32_t>(kb * kBlockK);
        const int32_t a_coords[2] = {k0, a_row};
        cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, sm.a(stage), a_map,
                                        a_coords, full);
        if constexpr (kBNMajor) {
          // [K, N] row-major: BN/64 boxes of 64 N-columns x 64 K-rows, 8 KiB apart.
#pragma unroll
          for (int i = 0; i < BN / 64; ++i) {
            const int32_t b_coords[2] = {n0 + 64 * i, k0};
            cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global,
                                            sm.b(stage) + i * 64 * kBlockK * 2, ops.b, b_coords, full);
          }
        } else {
          const int32_t b_coords[2] = {k0, n0};
          cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, sm.b(stage), ops.b,
                                          b_coords, full);
        }
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1;
        }
        return true;
      };
      const KRange range = k_range_of(item, k_blocks);
      const bool fold_tile = Fold::kEnabled && item.kind == static_cast<uint32_t>(WorkKind::kTileFold);
      const uint32_t split = fold_tile ? fold_position(range) : range.end;
      for (uint32_t kb = range.begin; kb < split; ++kb) {
        if (!load_k_block(kb)) return;  // consumers leave on the abort this raised
      }
      if constexpr (Fold::kEnabled) {
        if (fold_tile) {
          if (!load_partials(sm, ops, fold, item, n0, stage, phase, ctx)) return;
          for (uint32_t kb = split; kb < range.end; ++kb) {
            if (!load_k_block(kb)) return;
          }
        }
      }
    }
    st->producer_stage = stage;
    st->producer_phase = phase;
    st->producer_slot = slot;
    st->producer_slot_phase = slot_phase;
  }

  // Where a fold tile's staged partials sit in the stage ring: before its last kStages k-blocks
  // (after the last one for a short range). The producer loads them right behind the k-blocks
  // before, about kStages k-blocks ahead of the consumers, so they have landed when the
  // consumers get there. Placed after the last k-block, the fold took ~4 us per tile at 8192 x
  // 8192 x 7168, W = 2 (timeline), of ~80 us.
  __device__ static uint32_t fold_position(KRange r) {
    return r.end - r.begin > static_cast<uint32_t>(kStages) ? r.end - static_cast<uint32_t>(kStages) : r.end;
  }

  // Staged partials a fold item adds, per 64-column chunk: the other ranks', then its pieces'.
  __device__ static uint32_t pieces_of(const Fold& fold, const WorkItem& item) {
    if constexpr (requires { fold.piece_map(); }) {
      return item.split_count;
    } else {
      return 0;
    }
  }

  // At a fold tile's fold_position: waits until every other rank has staged its partial of the
  // tile (and every piece of a split tile is staged), then loads them through the stage ring in
  // the order the consumers add them: 64-column chunk by chunk; within a chunk the other ranks in
  // rank order (this rank's own accumulators are not loaded), then the pieces in slot order.
  __device__ static bool load_partials(const Smem& sm, const GemmOperands& ops, const Fold& fold, const WorkItem& item,
                                       int32_t n0, uint32_t& stage, uint32_t& phase, const WaitContext& ctx) {
    static_assert(Cfg::kABytes == BM * 64 * 2, "a staged 64-column x BLOCK_M box of 16-bit elements fills an A buffer");
    if (!fold.wait_sources(item, ctx)) return false;
    auto load_box = [&](const sm90::TmaDescriptor* map, int32_t col, int32_t row) -> bool {
      if (!sm90::mbarrier_wait(sm.empty(stage), phase ^ 1, ctx,
                               sm90::barrier_what(sm90::BarrierWhat::kStageEmpty, stage))) {
        return false;
      }
      uint64_t* full = sm.full(stage);
      constexpr uint32_t kBoxBytes = Cfg::kABytes;  // a local copy: the PTX wrapper takes a reference
      cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared, full,
                                           kBoxBytes);
      const int32_t coords[2] = {col, row};
      cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, sm.a(stage), map, coords, full);
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
      return true;
    };
    const uint32_t world = fold.world();
    const uint32_t self = fold.self();
#pragma unroll 1
    for (int c = 0; c < BN / 64; ++c) {
      const int32_t col = n0 + 64 * c;
      if (static_cast<uint32_t>(col) >= ops.n) break;  // the consumers skip these chunks too
#pragma unroll 1
      for (uint32_t s = 0; s < world; ++s) {
        if (s != self && !load_box(fold.map(), col, fold.source_row(item, s))) return false;
      }
      if constexpr (requires { fold.piece_map(); }) {
#pragma unroll 1
        for (uint32_t i = 0; i < item.split_count; ++i) {
          if (!load_box(fold.piece_map(), 64 * c, static_cast<int32_t>((item.split_slot + i) * BM))) return false;
        }
      }
    }
    return true;
  }

  // ---- consumers -------------------------------------------------------------------------------
  __device__ static void consumer(const Smem& sm, const GemmOperands& ops, Epilogue& epi, const Fold& fold, uint32_t g,
                                  const WaitContext& ctx) {
    const uint32_t t = threadIdx.x % 128;
    const uint32_t warp = t / 32;
    const uint32_t lane = t % 32;
    RoleState* st = sm.state();
    uint32_t stage = st->consumer_stage, phase = st->consumer_phase;
    uint32_t slot = st->consumer_slot, slot_phase = st->consumer_slot_phase;
    uint32_t parity = st->epi_parity;
    uint32_t signal_slot = st->signal_post & 0xFFFFu, signal_phase = st->signal_post >> 16;
    const uint32_t k_blocks = (ops.k + kBlockK - 1) / kBlockK;
    if (t == 0 && g == 0) epi.prefetch();

    float acc[kAcc];
    bool pending = false;  // a signal owed for `pending_item` once its writes have landed
    WorkItem pending_item{};
    WorkItem exit{static_cast<uint32_t>(WorkKind::kFailed), 0, 0, 0};

    for (;;) {
      if (!sm90::mbarrier_wait(sm.tile_full(slot), slot_phase, ctx,
                               sm90::barrier_what(sm90::BarrierWhat::kTileFull, slot))) {
        break;
      }
      const WorkItem item = load_item(sm.ring(slot));
      __syncwarp();
      if (lane == 0) cuda::ptx::mbarrier_arrive(sm.tile_empty(slot));
      if (++slot == kTileSlots) {
        slot = 0;
        slot_phase ^= 1;
      }
      if (!is_tile_kind(item.kind)) {
        exit = item;
        break;
      }

      // Mainloop: D = sum over k-blocks of A[64 rows of g, 64] * B[64, BN]; a fold tile adds the
      // staged partials where the producer put them in the ring (fold_position).
      const bool piece = item.kind == static_cast<uint32_t>(WorkKind::kTilePiece);
      const bool timed = ops.timeline != nullptr && g == 0 && t == 0 && record_index(ops, item) != kNoRecord;
      TileTimelineRecord* const record = timed ? &ops.timeline[record_index(ops, item)] : nullptr;
      const KRange range = k_range_of(item, k_blocks);
      const uint32_t fold_at = Fold::kEnabled && item.kind == static_cast<uint32_t>(WorkKind::kTileFold)
                                   ? fold_position(range)
                                   : ~0u;
      bool ok = true;
      bool in_flight = false;  // the previous k-block's wgmma may still read its stage
      uint32_t prev_stage = 0;
      for (uint32_t kb = range.begin; kb <= range.end; ++kb) {  // kb == end: only a fold after the last
        if constexpr (Fold::kEnabled) {
          if (kb == fold_at) {
            const uint64_t fold_begin = timed ? clock64() : 0;
            // fold_at > range.begin, so the previous k-block is in flight: drain it (the
            // accumulators are read and written next) and free its stage.
            sm90::wgmma_wait<0>();
            sm90::fence_operands(acc);
            if (lane == 0) cuda::ptx::mbarrier_arrive(sm.empty(prev_stage));
            in_flight = false;
            const uint64_t drained = timed ? clock64() : 0;
            // The previous tile's signal goes out before the fold may block: a fold waits for
            // other ranks' partials, and theirs may wait for this signal (deadlock otherwise).
            if (pending) {
              pending = false;
              if (!post_signal(sm, pending_item, g, warp, lane, signal_slot, signal_phase, ctx)) {
                ok = false;
                break;
              }
            }
            const uint64_t signalled = timed ? clock64() : 0;
            using Pair = typename std::conditional<kBF16, __nv_bfloat162, __half2>::type;
            if (!fold_partials<Pair>(sm, acc, item, ops, fold, g, warp, lane, stage, phase, ctx)) {
              ok = false;
              break;
            }
            if (timed) {
              TileTimelineRecord& rec = *record;
              rec.fold_cycles = static_cast<uint32_t>(clock64() - fold_begin);
              rec.fold_drain_cycles = static_cast<uint32_t>(drained - fold_begin);
              rec.fold_signal_cycles = static_cast<uint32_t>(signalled - drained);
            }
          }
        }
        if (kb == range.end) break;
        if (!sm90::mbarrier_wait(sm.full(stage), phase, ctx,
                                 sm90::barrier_what(sm90::BarrierWhat::kStageFull, stage))) {
          ok = false;
          break;
        }
        const uint64_t desc_a = sm90::make_smem_desc_sw128(sm90::smem_u32(sm.a(stage)) + g * 64 * 128, 16, 1024);
        const uint64_t desc_b =
            sm90::make_smem_desc_sw128(sm90::smem_u32(sm.b(stage)), kBNMajor ? 64 * kBlockK * 2 : 16, 1024);
        sm90::fence_operands(acc);
        sm90::wgmma_fence();
#pragma unroll
        for (int k = 0; k < kBlockK / 16; ++k) {
          // K-major: the next 16 columns are 32 bytes further along each 128-byte row.
          // N-major B: the next 16 K-rows are 16 * 128 bytes further.
          const uint64_t a_k = desc_a + static_cast<uint64_t>((k * 32) >> 4);
          const uint64_t b_k = desc_b + static_cast<uint64_t>(kBNMajor ? (k * 16 * 128) >> 4 : (k * 32) >> 4);
          sm90::wgmma_m64k16<BN, kBF16, kBNMajor ? 1 : 0>(acc, a_k, b_k, (kb > range.begin || k > 0) ? 1u : 0u);
        }
        sm90::wgmma_commit();
        sm90::fence_operands(acc);
        if (in_flight) {
          sm90::wgmma_wait<1>();  // the previous k-block's wgmma are done: its stage is free
          sm90::fence_operands(acc);
          if (lane == 0) cuda::ptx::mbarrier_arrive(sm.empty(prev_stage));
        }
        in_flight = true;
        prev_stage = stage;
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1;
        }
      }
      sm90::wgmma_wait<0>();
      sm90::fence_operands(acc);
      if (!ok) break;
      if (lane == 0 && in_flight) cuda::ptx::mbarrier_arrive(sm.empty(prev_stage));
      if (timed) record->mainloop_clock = clock64();
      if (pending) {  // a plain tile: its mainloop never blocks on other ranks
        if (!post_signal(sm, pending_item, g, warp, lane, signal_slot, signal_phase, ctx)) break;
        pending = false;
      }
      const uint32_t out = epi.out_dtype();
      if (out == 2u) {
        epilogue<float, 32>(sm, acc, item, epi, ops, g, warp, lane, parity);
      } else if (out == 1u) {
        epilogue<__half, 64>(sm, acc, item, epi, ops, g, warp, lane, parity);
      } else {
        epilogue<__nv_bfloat16, 64>(sm, acc, item, epi, ops, g, warp, lane, parity);
      }
      if (timed) record_stored(*record);
      if (epi.signals()) {
        if (piece) {
          // The tile's fold item (on another CTA, maybe already waiting) needs this piece now;
          // its writes are local, so waiting for them costs little.
          if (!post_signal(sm, item, g, warp, lane, signal_slot, signal_phase, ctx)) break;
        } else {
          pending = true;
          pending_item = item;
        }
      }
    }

    // Leave: the last signal and then the exit item (which ends the signaler) go to the
    // signaler, unless the launch is failing (the signaler then leaves on the abort); every
    // staged box must be out of shared memory.
    if (exit.kind != static_cast<uint32_t>(WorkKind::kFailed) && epi.signals()) {
      if ((pending && !post_signal(sm, pending_item, g, warp, lane, signal_slot, signal_phase, ctx)) ||
          !post_signal(sm, exit, g, warp, lane, signal_slot, signal_phase, ctx)) {
        exit = WorkItem{static_cast<uint32_t>(WorkKind::kFailed), 0, 0, 0};
      }
    }
    if (lane == 0) cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{});
    if (g == 0 && t == 0) {
      st->consumer_stage = stage;
      st->consumer_phase = phase;
      st->consumer_slot = slot;
      st->consumer_slot_phase = slot_phase;
      st->epi_parity = parity;
      st->signal_post = signal_slot | (signal_phase << 16);
      st->exit = exit;
    }
  }

  // Adds the staged partials of a fold tile into the accumulators, one 64-column chunk at a time,
  // the other sources in increasing order, then the tile's pieces in slot order:
  // acc = ((a + p_s1) + p_s2) + ... with a this rank's fp32 accumulator so far (the k-blocks of
  // its range before fold_position) and p_s the staged 16-bit partials; the remaining k-blocks
  // add to it and the epilogue rounds once. A fixed order, so
  // launch after launch gives the same bits; every element is summed by one rank (its owner).
  // Chunk c of source s sits in stage order exactly as load_partials issued it. Thread addressing
  // is the epilogue's: rows r and r + 8 of this warp's 16, the 16-byte chunk q of a 128-byte row
  // stored at q ^ (row % 8) (TMA's 128B swizzle), so one load instruction touches 32 banks.
  template <class Pair>
  __device__ static bool fold_partials(const Smem& sm, float (&acc)[kAcc], const WorkItem& item,
                                       const GemmOperands& ops, const Fold& fold, uint32_t g, uint32_t warp,
                                       uint32_t lane, uint32_t& stage, uint32_t& phase, const WaitContext& ctx) {
    const uint32_t boxes = fold.world() - 1 + pieces_of(fold, item);  // per chunk
    const uint32_t r = lane / 4;
    const uint32_t row = g * 64 + warp * 16 + r;  // this thread's first row in the BLOCK_M-row box
    const uint32_t col_bytes = (lane % 4) * 4;
    const uint32_t n0 = item.n_block * BN;
#pragma unroll
    for (int c = 0; c < BN / 64; ++c) {
      if (n0 + c * 64 >= ops.n) break;  // nothing was loaded past N (uniform over the CTA)
#pragma unroll 1
      for (uint32_t i = 0; i < boxes; ++i) {
        if (!add_staged_box<Pair>(sm, acc, c, row, r, col_bytes, lane, stage, phase, ctx)) return false;
      }
    }
    return true;
  }

  // One staged 64-column x BLOCK_M box (chunk c of the tile) from the stage ring into the
  // accumulators, then its stage is freed. Inlined into the unrolled chunk loop: c must be a
  // constant there, or the accumulators would be indexed at run time (local memory).
  template <class Pair>
  __device__ __forceinline__ static bool add_staged_box(const Smem& sm, float (&acc)[kAcc], int c, uint32_t row,
                                                        uint32_t r, uint32_t col_bytes, uint32_t lane, uint32_t& stage,
                                                        uint32_t& phase, const WaitContext& ctx) {
    if (!sm90::mbarrier_wait(sm.full(stage), phase, ctx, sm90::barrier_what(sm90::BarrierWhat::kStageFull, stage))) {
      return false;
    }
    const uint32_t box = sm90::smem_u32(sm.a(stage));
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const uint32_t off = ((static_cast<uint32_t>(q) ^ r) << 4) + col_bytes;
      uint32_t lo, hi;
      asm volatile("ld.shared.b32 %0, [%1];" : "=r"(lo) : "r"(box + row * 128 + off) : "memory");
      asm volatile("ld.shared.b32 %0, [%1];" : "=r"(hi) : "r"(box + (row + 8) * 128 + off) : "memory");
      const float2 f_lo = unpack2<Pair>(lo);
      const float2 f_hi = unpack2<Pair>(hi);
      // acc[4j .. 4j+3] with j = 8c + q: (row, cols 2(l%4) + {0,1}), then (row + 8, same cols).
      float* a4 = acc + 32 * c + 4 * q;
      a4[0] += f_lo.x;
      a4[1] += f_lo.y;
      a4[2] += f_hi.x;
      a4[3] += f_hi.y;
    }
    __syncwarp();
    if (lane == 0) cuda::ptx::mbarrier_arrive(sm.empty(stage));
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
    return true;
  }

  template <class Pair>
  __device__ static float2 unpack2(uint32_t bits) {
    static_assert(sizeof(Pair) == sizeof(bits), "a pair of 16-bit elements is 4 bytes");
    const Pair v = *reinterpret_cast<const Pair*>(&bits);
    if constexpr (__is_same(Pair, __half2)) {
      return __half22float2(v);
    } else {
      return __bfloat1622float2(v);
    }
  }

  // Timeline records (diagnostics; the hot loops only test a pointer when none is given).
  // A tile's record is at its tile index; a split tile's pieces follow all tiles, by piece slot,
  // while they fit the buffer's tile_timeline_capacity (loom/diagnostics.h).
  static constexpr uint32_t kNoRecord = ~0u;
  __device__ static uint32_t record_index(const GemmOperands& ops, const WorkItem& item) {
    if (item.kind != static_cast<uint32_t>(WorkKind::kTilePiece)) return item.tile;
    const uint32_t index = ((ops.m + BM - 1) / BM) * ((ops.n + BN - 1) / BN) + item.split_slot;
    const uint32_t capacity = ((ops.m + 63) / 64) * ((ops.n + 63) / 64);  // tile_timeline_capacity(M, N)
    return index < capacity ? index : kNoRecord;
  }
  __device__ static void record_claim(TileTimelineRecord& r, const WorkItem& item) {
    r.claimed_ns = global_timer_ns();
    r.claimed_clock = clock64();
    r.cta = blockIdx.x;
    uint32_t smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    r.smid = smid;
    r.kind = item.kind;
  }
  __device__ static void record_stored(TileTimelineRecord& r) {
    r.stored_ns = global_timer_ns();
    r.stored_clock = clock64();
  }

  // A consumer warp hands a finished tile (or, at the exit, the exit item) to the signaler: lane 0
  // waits until the warp's bulk writes have completed and makes them visible to the generic
  // proxy, takes the next signal slot, and arrives; warpgroup 1's first warp also writes the
  // item. Every consumer warp posts the same items in the same order. False after a failed wait.
  __device__ static bool post_signal(const Smem& sm, const WorkItem& item, uint32_t g, uint32_t warp, uint32_t lane,
                                     uint32_t& slot, uint32_t& phase, const WaitContext& ctx) {
    bool ok = true;
    if (lane == 0) {
      cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{});
      cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
      ok = sm90::mbarrier_wait(sm.signal_empty(slot), phase ^ 1, ctx,
                               sm90::barrier_what(sm90::BarrierWhat::kSignalEmpty, slot));
      if (ok) {
        if (g == 0 && warp == 0) *sm.signal_ring(slot) = item;
        cuda::ptx::mbarrier_arrive(sm.signal_full(slot));  // release: the item and the writes above
      }
    }
    ok = __shfl_sync(0xFFFFFFFFu, ok ? 1 : 0, 0) != 0;
    if (++slot == kTileSlots) {
      slot = 0;
      phase ^= 1;
    }
    return ok;
  }

  // ---- signaler (one thread of the producer warpgroup) ------------------------------------------
  // Signals each tile the consumers post, in their order, until the exit item; leaves on a
  // failed (aborted) wait, when the consumers post nothing more.
  __device__ static void signaler(const Smem& sm, const GemmOperands& ops, const Epilogue& epi, const WaitContext& ctx) {
    RoleState* st = sm.state();
    uint32_t slot = st->signal_take & 0xFFFFu, phase = st->signal_take >> 16;
    const uint32_t m_blocks = (ops.m + BM - 1) / BM;
    const uint32_t n_blocks = (ops.n + BN - 1) / BN;
    for (;;) {
      if (!sm90::mbarrier_wait(sm.signal_full(slot), phase, ctx, sm90::barrier_what(sm90::BarrierWhat::kSignalFull, slot))) {
        return;
      }
      const WorkItem item = load_item(sm.signal_ring(slot));
      if (is_tile_kind(item.kind)) epi.signal(item, m_blocks, n_blocks);
      cuda::ptx::mbarrier_arrive(sm.signal_empty(slot));
      if (++slot == kTileSlots) {
        slot = 0;
        phase ^= 1;
      }
      if (!is_tile_kind(item.kind)) break;
    }
    st->signal_take = slot | (phase << 16);
  }

  template <class OutT>
  __device__ static uint32_t pack2(float lo, float hi) {
    if constexpr (sizeof(OutT) == 2 && __is_same(OutT, __half)) {
      const __half2 v = __floats2half2_rn(lo, hi);
      return *reinterpret_cast<const uint32_t*>(&v);
    } else {
      const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
      return *reinterpret_cast<const uint32_t*>(&v);
    }
  }

  // Accumulator layout (m64nN, fp32): thread lane l of warp w holds, for each n8 block j,
  // rows 16w + l/4 (acc[4j], acc[4j+1]) and 16w + 8 + l/4 (acc[4j+2], acc[4j+3]) at columns
  // 8j + 2(l%4) + {0, 1}. A box is the warp's 16 rows x kCols columns (128 bytes per row); the
  // 16-byte chunk q of row r is stored at chunk q ^ (r % 8) (TMA's 128B swizzle), which keeps
  // the eight rows one store instruction touches in distinct banks.
  template <class OutT, int kCols>
  __device__ static void epilogue(const Smem& sm, float (&acc)[kAcc], const WorkItem& item, const Epilogue& epi,
                                  const GemmOperands& ops, uint32_t g, uint32_t warp, uint32_t lane,
                                  uint32_t& parity) {
    static_assert(kCols * sizeof(OutT) == 128, "a staged row is 128 bytes");
    const uint32_t row0 = item.m_block * BM + g * 64 + warp * 16;
    const uint32_t col0 = item.n_block * BN;
    if (row0 >= ops.m) return;  // all 16 rows of this warp lie past M
    const uint32_t r = lane / 4;
#pragma unroll
    for (int c = 0; c < BN / kCols; ++c) {
      if (col0 + c * kCols >= ops.n) break;  // past N (uniform across the warp)
      uint8_t* box = sm.epi(g, warp, parity);
      // The box written two chunks ago (same buffer) must have been read out by TMA.
      if (lane == 0) cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<1>{});
      __syncwarp();
      const uint32_t box_addr = sm90::smem_u32(box);
      if constexpr (sizeof(OutT) == 2) {
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          const int j = c * 8 + q;
          const uint32_t lo = pack2<OutT>(acc[4 * j], acc[4 * j + 1]);
          const uint32_t hi = pack2<OutT>(acc[4 * j + 2], acc[4 * j + 3]);
          const uint32_t off = ((static_cast<uint32_t>(q) ^ r) << 4) + (lane % 4) * 4;
          asm volatile("st.shared.b32 [%0], %1;" ::"r"(box_addr + r * 128 + off), "r"(lo) : "memory");
          asm volatile("st.shared.b32 [%0], %1;" ::"r"(box_addr + (r + 8) * 128 + off), "r"(hi) : "memory");
        }
      } else {
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const int j = c * 4 + jj;
          const uint32_t q = 2 * jj + (lane % 4) / 2;
          const uint32_t off = ((q ^ r) << 4) + (lane % 2) * 8;
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(box_addr + r * 128 + off), "f"(acc[4 * j]),
                       "f"(acc[4 * j + 1])
                       : "memory");
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(box_addr + (r + 8) * 128 + off),
                       "f"(acc[4 * j + 2]), "f"(acc[4 * j + 3])
                       : "memory");
        }
      }
      // Generic-proxy stores must be visible to the async proxy (TMA) that reads the box.
      cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
      __syncwarp();
      if (lane == 0) {
        epi.issue(box, item, row0, col0 + c * kCols);
        cuda::ptx::cp_async_bulk_commit_group();
      }
      parity ^= 1;
    }
  }
};

}  // namespace loom::kernels::gemm
