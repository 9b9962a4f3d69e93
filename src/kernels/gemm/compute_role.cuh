// The GEMM engine's compute role: one persistent CTA's share of D = A * B, callable from any
// kernel (the standalone GEMM kernel, or a fused kernel whose role table makes this CTA a
// compute CTA).
//
// Roles inside the CTA (Cfg::kThreads threads; the enums of warp_roles.cuh):
//   warpgroup 0            WarpGroupRole::kProducer. ProducerWarpRole::kMainloop (its lane 0)
//                          asks the scheduler for tiles (the scheduler may gate each tile on its
//                          arrival flags), publishes them in the tile ring and issues the TMA
//                          loads of A and B into the kStages-deep ring of stages.
//                          ProducerWarpRole::kSignaler (when the epilogue signals): it takes
//                          finished tiles from the signal ring and calls Epilogue::signal (system
//                          fence, flag stores into peers: microseconds that would otherwise stall
//                          a consumer warpgroup every tile). Registers drop to kProducerRegs.
//                          The other threads idle.
//   warpgroups 1..C        WarpGroupRole::kConsumer: read the tile ring, run the wgmma mainloop
//                          (warpgroup g owns tile rows [64g, 64g + 64), m64nBNk16 per k16, one
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
// gates) and leaves cleanly on failure. The consumers end the signaler with the exit item. The
// ring positions persist in shared memory (RoleState) between run() calls: each side reads its
// own on entry; the consumers' are written back by one thread after a consumers' barrier
// (RoleBarrier::kConsumers), once every consumer warp has read them.
//
// Use from a kernel launched with Cfg::kThreads threads, __launch_bounds__(Cfg::kThreads, 1) and
// Cfg::kSmemBytes of dynamic shared memory:
//   Role::init(smem);                                           // every thread, once per launch
//   WorkItem exit = Role::run(smem, operands, sched, epi, index, count, ctx);  // every thread
// run() returns (to every thread, after a CTA barrier) the item that ended it: kDone, kFailed,
// or kYield, after which the caller may run another role and call run() again (the pipeline
// state persists in shared memory; the scheduler object must be the same).
//
// The pieces (each its own file, reusable by other kernels on the engine): role_smem.cuh (the
// shared-memory layout and persisted RoleState), operands.cuh (GemmOperands), pipeline.cuh
// (PipelineState: a ring's slot and phase), mainloop_sm90.cuh (one k-block's TMA loads, one
// k-block's wgmma), fold.cuh (the opt-in Fold policy: fused reduce-scatter and tail-split
// pieces), signaler.cuh (the signal ring), epilogue_stage.cuh (accumulators to swizzled boxes
// to the epilogue), timeline.cuh.
#pragma once

#include <cuda/ptx>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/comm/wait.cuh"
#include "kernels/common/sm90.cuh"
#include "kernels/gemm/config.h"
#include "kernels/gemm/epilogue_stage.cuh"
#include "kernels/gemm/fold.cuh"
#include "kernels/gemm/mainloop_sm90.cuh"
#include "kernels/gemm/operands.cuh"
#include "kernels/gemm/params.h"
#include "kernels/gemm/pipeline.cuh"
#include "kernels/gemm/role_smem.cuh"
#include "kernels/gemm/signaler.cuh"
#include "kernels/gemm/swap_tail.cuh"
#include "kernels/gemm/timeline.cuh"
#include "kernels/gemm/warp_roles.cuh"

namespace loom::kernels::gemm {

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
  // Tiles with their own row ranges (a grouped GEMM over unpadded groups, operands.cuh).
  static constexpr bool kRowRanges = ranges_rows<Scheduler>();
  // Two GEMMs through one role (operands.cuh: GemmOperands::second, a paired epilogue).
  static constexpr bool kPaired = paired_epilogue<Epilogue>();
  static_assert(!(kPaired && Fold::kEnabled), "a paired role cannot fold partial tiles: the fold reads one GEMM's maps");
  static_assert(!(kRowRanges && Fold::kEnabled),
                "a scheduler with row ranges cannot fold partial tiles: the fold addresses staged rows by m_block");

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

  __device__ __forceinline__ static WorkItem run(uint8_t* smem_raw, const GemmOperands& ops, Scheduler& sched,
                                                 Epilogue& epi, uint32_t compute_index, uint32_t num_compute,
                                                 const WaitContext& ctx) {
    static_assert(!Fold::kEnabled, "a role that folds partial tiles must be given its Fold policy");
    return run(smem_raw, ops, sched, epi, compute_index, num_compute, ctx, Fold{});
  }

  __device__ __forceinline__ static WorkItem run(uint8_t* smem_raw, const GemmOperands& ops, Scheduler& sched,
                                                 Epilogue& epi, uint32_t compute_index, uint32_t num_compute,
                                                 const WaitContext& ctx, const Fold& fold) {
    const Smem sm(smem_raw);
    const uint32_t warpgroup = threadIdx.x / kWarpGroupThreads;
    const WarpGroupRole role = warp_group_role(warpgroup);
    // Each branch ends at kEntryRegs, after the same CTA barrier (barrier 0, one instruction in
    // each branch), so that ptxas allocates the caller's code after run() at kEntryRegs: with the
    // producer's increase in an `if` after the branches joined, ptxas took the join as possibly
    // still at kProducerRegs and compiled moe_layer's combine at 40 registers (most of its loads
    // spilled to local memory at once). The producer takes its registers back only after the
    // barrier: the CTA's pool is exactly the consumers' kConsumerRegs plus the producer's
    // kProducerRegs, so had it done so right after a quick producer loop (a CTA that got no tile),
    // before the consumers' increase was granted, the consumers' setmaxnreg.inc would wait forever
    // (a hang no abort reaches).
    // setmaxnreg and bar.sync are .aligned: the sm90 helpers rejoin each warp's lanes first (the
    // elected producer and signaler lanes come back from their loops at different times).
    if (role == WarpGroupRole::kProducer) {
      if constexpr (kManageRegisters) sm90::setmaxnreg_dec<Cfg::kProducerRegs>();
      if (threadIdx.x == elected_thread(ProducerWarpRole::kMainloop)) {
        producer(sm, ops, sched, fold, compute_index, num_compute, ctx);
      }
      if (threadIdx.x == elected_thread(ProducerWarpRole::kSignaler) && epi.signals()) {
        Signals::signaler(sm, ops, epi, ctx);
      }
      sm90::named_barrier_sync(static_cast<uint32_t>(RoleBarrier::kCta), Cfg::kThreads);  // = __syncthreads
      if constexpr (kManageRegisters) sm90::setmaxnreg_inc<Cfg::kEntryRegs>();
    } else {
      if constexpr (kManageRegisters) sm90::setmaxnreg_inc<Cfg::kConsumerRegs>();
      consumer(sm, ops, epi, fold, consumer_index(warpgroup), ctx);
      if constexpr (kManageRegisters) sm90::setmaxnreg_dec<Cfg::kEntryRegs>();
      sm90::named_barrier_sync(static_cast<uint32_t>(RoleBarrier::kCta), Cfg::kThreads);  // = __syncthreads
    }
    const WorkItem exit = sm.state()->exit;
    __syncthreads();  // the next run() may overwrite it
    return exit;
  }

 private:
  using Smem = RoleSmem<Cfg>;
  using Timeline = TileTimeline<BM, BN>;
  using Folding = TileFold<Cfg, Fold>;
  using Signals = TileSignaler<Cfg, Epilogue>;
  using Staging = EpilogueStage<BM, BN>;
  using Loads = Sm90Loads<Cfg, kBNMajor, groups_tiles<Scheduler>()>;
  using Swap = SwapTail<Cfg, kBF16, kBNMajor, kRowRanges>;
  // With swapped tiles the normal tile's wgmma write the same m64n128 accumulator blocks as the
  // swapped ones (ptxas serializes every wgmma of the kernel, C7511, when one m64n256 block and
  // the swapped m64 blocks share registers).
  using Mma = Sm90Mma<BN, kBF16, kBNMajor, Swap::kEnabled ? Swap::kSliceN : BN>;
  using Pair = typename std::conditional<kBF16, __nv_bfloat162, __half2>::type;  // two input elements

  // ---- producer (one thread) -----------------------------------------------------------------
  __device__ static void producer(const Smem& sm, const GemmOperands& ops, Scheduler& sched, const Fold& fold,
                                  uint32_t compute_index, uint32_t num_compute, const WaitContext& ctx) {
    RoleState* st = sm.state();
    auto stages = PipelineState<kStages>::at(st->producer_stage);
    auto tiles = PipelineState<kTileSlots>::at(st->producer_tile);
    sm90::prefetch_tensormap(ops.a);
    sm90::prefetch_tensormap(ops.b);
    if (ops.a_local != nullptr) sm90::prefetch_tensormap(ops.a_local);
    if (ops.a_rows != nullptr) sm90::prefetch_tensormap(ops.a_rows);
    if constexpr (Fold::kEnabled) sm90::prefetch_tensormap(fold.map());
    if constexpr (kPaired) {
      sm90::prefetch_tensormap(ops.second->a);
      if (ops.second->a_rows != nullptr) sm90::prefetch_tensormap(ops.second->a_rows);
      sm90::prefetch_tensormap(ops.second->b);
      if (ops.b_local != nullptr) sm90::prefetch_tensormap(ops.b_local);
      if (ops.second->b_local != nullptr) sm90::prefetch_tensormap(ops.second->b_local);
    }
    const uint32_t own_k_blocks = (ops.k + kBlockK - 1) / kBlockK;

    for (;;) {
      const WorkItem item = sched.next(compute_index, num_compute, ctx);
      // Publish the item (tiles, and the sentinel that tells the consumers to leave).
      if (!tiles.wait_released(sm.tile_empty(tiles.index), ctx, sm90::BarrierWhat::kTileEmpty)) {
        return;  // consumers leave on the abort this raised
      }
      *sm.ring(tiles.index) = item;
      cuda::ptx::mbarrier_arrive(sm.tile_full(tiles.index));
      tiles.advance();
      if (!is_tile_kind_of<kPaired>(item.kind)) break;
      if (ops.timeline != nullptr && Timeline::record_index(ops, item) != Timeline::kNoRecord) {
        Timeline::record_claim(ops.timeline[Timeline::record_index(ops, item)], item);
      }

      const auto& o = operands_of<kPaired>(ops, item);
      const uint32_t k_blocks = kPaired ? (o.k + kBlockK - 1) / kBlockK : own_k_blocks;
      const int32_t m0 = static_cast<int32_t>(tile_rows<BM, kRowRanges>(item, o.m).first);
      const int32_t n0 = static_cast<int32_t>(item.n_block * BN);
      const sm90::TmaDescriptor* a_map = o.a;
      const sm90::TmaDescriptor* b_map = o.b;
      int32_t a_row = m0;
      int32_t group = static_cast<int32_t>(item.group);
      const bool local = static_cast<uint32_t>(m0) >= o.local_row_begin && static_cast<uint32_t>(m0) < o.local_row_end;
      if (o.a_local != nullptr && local) {
        a_map = o.a_local;
        a_row = m0 - static_cast<int32_t>(o.local_row_begin);
      }
      if constexpr (kPaired) {  // b_local is a paired role's (operands.cuh): the others keep their registers
        if (o.b_local != nullptr && local) {
          b_map = o.b_local;
          group = 0;
        }
      }
      ASource a_source{a_map, a_row};
      if constexpr (kRowRanges && !Fold::kEnabled) {
        // A tile row that ends inside the tile loads only its rows of A (GemmOperands::a_rows).
        const TileRows rows = tile_rows<BM, kRowRanges>(item, o.m);
        if (o.a_rows != nullptr && a_map == o.a && rows.limit - rows.first < static_cast<uint32_t>(BM)) {
          a_source.map = o.a_rows;
          a_source.row_boxes = (rows.limit - rows.first + kTailRowBox - 1) / kTailRowBox;
        }
      }
      auto load_k_block = [&](uint32_t kb) -> bool {
        return Loads::load_k_block(sm, stages, a_source, b_map, n0, kb, ctx, group);
      };
      const KRange range = k_range_of(item, k_blocks);
      const bool fold_tile = Fold::kEnabled && item.kind == static_cast<uint32_t>(WorkKind::kTileFold);
      const uint32_t split = fold_tile ? Folding::fold_position(range) : range.end;
      for (uint32_t kb = range.begin; kb < split; ++kb) {
        if (!load_k_block(kb)) return;  // consumers leave on the abort this raised
      }
      if constexpr (Fold::kEnabled) {
        if (fold_tile) {
          if (!Folding::load_partials(sm, ops, fold, item, n0, stages, ctx)) return;
          for (uint32_t kb = split; kb < range.end; ++kb) {
            if (!load_k_block(kb)) return;
          }
        }
      }
    }
    st->producer_stage = stages.position();
    st->producer_tile = tiles.position();
  }

  // ---- consumers -------------------------------------------------------------------------------
  // The accumulators of `item` through one epilogue policy, in its output type.
  template <class E>
  __device__ static void store_tile(const Smem& sm, float (&acc)[kAcc], const WorkItem& item, const E& e,
                                    const GemmOperands& o, uint32_t g, uint32_t warp, uint32_t lane, uint32_t& parity) {
    const uint32_t out = e.out_dtype();
    if (out == 2u) {
      Staging::template store<float, 32, kRowRanges>(sm, acc, item, e, o, g, warp, lane, parity);
    } else if (out == 1u) {
      Staging::template store<__half, 64, kRowRanges>(sm, acc, item, e, o, g, warp, lane, parity);
    } else {
      Staging::template store<__nv_bfloat16, 64, kRowRanges>(sm, acc, item, e, o, g, warp, lane, parity);
    }
  }

  // After a k-block's wgmma were issued (one commit group): the previous k-block's group is done
  // (one may stay in flight), so its stage goes back to the producer; this one's becomes the
  // previous.
  __device__ __forceinline__ static void issued_k_block(const Smem& sm, float (&acc)[kAcc], uint32_t lane,
                                                        PipelineState<kStages>& stages, bool& in_flight,
                                                        uint32_t& prev_stage) {
    if (in_flight) {
      sm90::wgmma_wait<1>();
      sm90::fence_operands(acc);
      if (lane == 0) cuda::ptx::mbarrier_arrive(sm.empty(prev_stage));
    }
    in_flight = true;
    prev_stage = stages.index;
    stages.advance();
  }

  // A swapped tile's mainloop (swap_tail.cuh), a loop of its own per N: with the swapped and the
  // normal wgmma in one loop, ptxas serializes every wgmma of the kernel (C7511). Waits for,
  // consumes and frees every stage of the range like the normal loop; false after a failed wait.
  __device__ __forceinline__ static bool swapped_mainloop(const Smem& sm, float (&acc)[kAcc],
                                                          PipelineState<kStages>& stages, const KRange& range,
                                                          uint32_t g, uint32_t lane, uint32_t swap_rows,
                                                          const WaitContext& ctx) {
    bool ok = true;
    Swap::with_n(swap_rows, [&](auto n) {
      bool in_flight = false;
      uint32_t prev_stage = 0;
      for (uint32_t kb = range.begin; kb < range.end; ++kb) {
        if (!stages.wait_filled(sm.full(stages.index), ctx, sm90::BarrierWhat::kStageFull)) {
          ok = false;
          break;
        }
        Swap::template mma_k_block<decltype(n)::value>(acc, sm90::smem_u32(sm.a(stages.index)),
                                                       sm90::smem_u32(sm.b(stages.index)), g, kb > range.begin);
        issued_k_block(sm, acc, lane, stages, in_flight, prev_stage);
      }
      sm90::wgmma_wait<0>();
      sm90::fence_operands(acc);
      if (ok && lane == 0 && in_flight) cuda::ptx::mbarrier_arrive(sm.empty(prev_stage));
    });
    return ok;
  }

  // A tile's accumulators through one epilogue policy: swapped (swap_rows != 0, swap_tail.cuh) or
  // staged.
  template <class E>
  __device__ __forceinline__ static void finish_tile(const Smem& sm, float (&acc)[kAcc], const WorkItem& item,
                                                     const E& e, const GemmOperands& o, uint32_t g, uint32_t warp,
                                                     uint32_t lane, uint32_t& parity, uint32_t swap_rows) {
    if (swap_rows != 0) {
      Swap::with_n(swap_rows, [&](auto n) {
        Swap::template store<decltype(n)::value>(sm, acc, item, e, o, g, warp, lane, swap_rows);
      });
    } else {
      store_tile(sm, acc, item, e, o, g, warp, lane, parity);
    }
  }

  // Inlined like run(), also when the kernel around it is large (moe_layer): a wgmma pipeline
  // that crosses a call is serialized (ptxas C7510).
  __device__ __forceinline__ static void consumer(const Smem& sm, const GemmOperands& ops, Epilogue& epi,
                                                  const Fold& fold, uint32_t g, const WaitContext& ctx) {
    const uint32_t t = threadIdx.x % 128;
    const uint32_t warp = t / 32;
    const uint32_t lane = t % 32;
    RoleState* st = sm.state();
    auto stages = PipelineState<kStages>::at(st->consumer_stage);
    auto tiles = PipelineState<kTileSlots>::at(st->consumer_tile);
    auto signals = PipelineState<kTileSlots>::at(st->signal_post);
    uint32_t parity = st->epi_parity;
    const uint32_t own_k_blocks = (ops.k + kBlockK - 1) / kBlockK;
    if (t == 0 && g == 0) epi.prefetch();

    float acc[kAcc];
    bool pending = false;  // a signal owed for `pending_item` once its writes have landed
    WorkItem pending_item{};
    WorkItem exit{static_cast<uint32_t>(WorkKind::kFailed), 0, 0, 0};

    for (;;) {
      if constexpr (gates_on_own_signals<Scheduler>()) {
        // The owed signal goes out now unless the next tile is already there (lane 0 decides, so
        // that the warp stays converged for post_signal; warps may decide differently: each
        // still posts the same items in the same order).
        const bool waiting = lane == 0 && !tiles.is_filled(sm.tile_full(tiles.index));
        const bool idle = __shfl_sync(0xFFFFFFFFu, waiting ? 1 : 0, 0) != 0;
        if (pending && idle) {
          pending = false;
          if (!Signals::post_signal(sm, pending_item, g, warp, lane, signals, ctx)) break;
        }
      }
      if (!tiles.wait_filled(sm.tile_full(tiles.index), ctx, sm90::BarrierWhat::kTileFull)) break;
      const WorkItem item = load_item(sm.ring(tiles.index));
      __syncwarp();
      if (lane == 0) cuda::ptx::mbarrier_arrive(sm.tile_empty(tiles.index));
      tiles.advance();
      if (!is_tile_kind_of<kPaired>(item.kind)) {
        exit = item;
        break;
      }

      // Mainloop: D = sum over k-blocks of A[64 rows of g, 64] * B[64, BN]; a fold tile adds the
      // staged partials where the producer put them in the ring (fold_position).
      const bool piece = item.kind == static_cast<uint32_t>(WorkKind::kTilePiece);
      const bool timed = ops.timeline != nullptr && g == 0 && t == 0 && Timeline::record_index(ops, item) != Timeline::kNoRecord;
      TileTimelineRecord* const record = timed ? &ops.timeline[Timeline::record_index(ops, item)] : nullptr;
      const auto& o = operands_of<kPaired>(ops, item);
      KRange range = k_range_of(item, kPaired ? (o.k + kBlockK - 1) / kBlockK : own_k_blocks);
      const uint32_t fold_at = Fold::kEnabled && item.kind == static_cast<uint32_t>(WorkKind::kTileFold)
                                   ? Folding::fold_position(range)
                                   : ~0u;
      // A group's last partial tile row runs swapped (swap_tail.cuh: its rows as wgmma's N).
      // Otherwise a warpgroup whose 64 rows all lie past the tile's row limit (the last partial
      // tile row of M) issues no wgmma: it still waits for every stage and frees it, and its
      // stores skip those rows, so the other warpgroup has the tensor cores to itself. Folded
      // tiles read every row.
      const TileRows rows = tile_rows<BM, kRowRanges>(item, o.m);
      const uint32_t swap_rows = o.swap_tails ? Swap::rows(rows) : 0u;
      const bool mma_rows = Fold::kEnabled || rows.first + g * 64 < rows.limit;
      bool ok = true;
      bool in_flight = false;  // the previous k-block's wgmma may still read its stage
      uint32_t prev_stage = 0;
      if (swap_rows != 0) {
        ok = swapped_mainloop(sm, acc, stages, range, g, lane, swap_rows, ctx);
        range.end = range.begin;  // the loop below only ends the tile
      }
      for (uint32_t kb = range.begin; kb <= range.end; ++kb) {  // kb == end: only a fold after the last
        if constexpr (Fold::kEnabled) {
          if (kb == fold_at) {
            // fold_at > range.begin: the k-block in flight is drained (the accumulators are read
            // and written next) and its stage freed; the previous tile's signal goes out before
            // the fold may block (a fold waits for other ranks' partials, and theirs may wait for
            // this signal: deadlock otherwise).
            const uint64_t fold_begin = timed ? clock64() : 0;
            Folding::drain(sm, acc, lane, prev_stage);
            in_flight = false;
            const uint64_t drained = timed ? clock64() : 0;
            if (pending) {
              pending = false;
              if (!Signals::post_signal(sm, pending_item, g, warp, lane, signals, ctx)) {
                ok = false;
                break;
              }
            }
            const uint64_t signalled = timed ? clock64() : 0;
            if (!Folding::template fold_partials<Pair>(sm, acc, item, ops, fold, g, warp, lane, stages, ctx)) {
              ok = false;
              break;
            }
            if (timed) Timeline::record_fold(*record, fold_begin, drained, signalled);
          }
        }
        if (kb == range.end) break;
        if (!stages.wait_filled(sm.full(stages.index), ctx, sm90::BarrierWhat::kStageFull)) {
          ok = false;
          break;
        }
        if (mma_rows) {
          Mma::mma_k_block(acc, sm90::smem_u32(sm.a(stages.index)) + g * 64 * 128, sm90::smem_u32(sm.b(stages.index)),
                           kb > range.begin);
        }
        issued_k_block(sm, acc, lane, stages, in_flight, prev_stage);
      }
      sm90::wgmma_wait<0>();
      sm90::fence_operands(acc);
      if (!ok) break;
      if (lane == 0 && in_flight) cuda::ptx::mbarrier_arrive(sm.empty(prev_stage));
      if (timed) record->mainloop_clock = clock64();
      if (pending) {  // a plain tile: its mainloop never blocks on other ranks
        if (!Signals::post_signal(sm, pending_item, g, warp, lane, signals, ctx)) break;
        pending = false;
      }
      if constexpr (kPaired) {
        if (item.kind == static_cast<uint32_t>(WorkKind::kTileSecond)) {
          finish_tile(sm, acc, item, epi.second(), o, g, warp, lane, parity, swap_rows);
        } else {
          finish_tile(sm, acc, item, epi.first(), o, g, warp, lane, parity, swap_rows);
        }
      } else {
        finish_tile(sm, acc, item, epi, o, g, warp, lane, parity, swap_rows);
      }
      if (timed) Timeline::record_stored(*record);
      if (epi.signals()) {
        if (piece) {
          // The tile's fold item (on another CTA, maybe already waiting) needs this piece now;
          // its writes are local, so waiting for them costs little.
          if (!Signals::post_signal(sm, item, g, warp, lane, signals, ctx)) break;
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
      if ((pending && !Signals::post_signal(sm, pending_item, g, warp, lane, signals, ctx)) ||
          !Signals::post_signal(sm, exit, g, warp, lane, signals, ctx)) {
        exit = WorkItem{static_cast<uint32_t>(WorkKind::kFailed), 0, 0, 0};
      }
    }
    if (lane == 0) cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{});
    // Every consumer warp read the persisted positions on entry before one thread overwrites
    // them. Without this barrier a CTA whose first item was kDone (moe_layer's dispatch CTAs
    // join the queue late) let its first warp overwrite them while another warp still waited
    // for its registers (setmaxnreg.inc); that warp then read the next slot's position, waited
    // for a tile that never comes, and the launch timed out.
    sm90::named_barrier_sync(static_cast<uint32_t>(RoleBarrier::kConsumers), Cfg::kConsumers * kWarpGroupThreads);
    if (g == 0 && t == 0) {
      st->consumer_stage = stages.position();
      st->consumer_tile = tiles.position();
      st->signal_post = signals.position();
      st->epi_parity = parity;
      st->exit = exit;
    }
  }
};

}  // namespace loom::kernels::gemm
