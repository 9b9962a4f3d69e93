// The signal ring between the compute role's consumers and its signaler thread: the consumers
// post each finished tile (and finally the exit item) once its bulk writes have landed, the
// signaler calls Epilogue::signal for it (system fence, flag stores into peers). Separate from
// the role because it is the only part that talks to other GPUs, and a consumer warpgroup
// doing it itself lost ~5 us per signalling tile (docs/GEMM.md).
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/wait.cuh"
#include "kernels/common/sm90.cuh"
#include "kernels/gemm/config.h"
#include "kernels/gemm/operands.cuh"
#include "kernels/gemm/params.h"
#include "kernels/gemm/pipeline.cuh"
#include "kernels/gemm/role_smem.cuh"

namespace loom::kernels::gemm {

// Synchronisation: signal_full[t] (one arrival per consumer warp; the item is written by
// warpgroup 1's first warp), signal_empty[t] (the signaler). Both ends keep their ring position
// (a PipelineState) in RoleState between run() calls.
template <class Cfg, class Epilogue>
struct TileSignaler {
  using Smem = RoleSmem<Cfg>;
  static constexpr int BM = Cfg::kBlockM;
  static constexpr int BN = Cfg::kBlockN;

  // A consumer warp hands a finished tile (or, at the exit, the exit item) to the signaler: lane 0
  // waits until the warp's bulk writes have completed and makes them visible to the generic
  // proxy, takes the next signal slot, and arrives; warpgroup 1's first warp also writes the
  // item. Every consumer warp posts the same items in the same order. False after a failed wait.
  __device__ static bool post_signal(const Smem& sm, const WorkItem& item, uint32_t g, uint32_t warp, uint32_t lane,
                                     PipelineState<kTileSlots>& slots, const WaitContext& ctx) {
    bool ok = true;
    if (lane == 0) {
      cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{});
      cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
      ok = slots.wait_released(sm.signal_empty(slots.index), ctx, sm90::BarrierWhat::kSignalEmpty);
      if (ok) {
        if (g == 0 && warp == 0) *sm.signal_ring(slots.index) = item;
        cuda::ptx::mbarrier_arrive(sm.signal_full(slots.index));  // release: the item and the writes above
      }
    }
    ok = __shfl_sync(0xFFFFFFFFu, ok ? 1 : 0, 0) != 0;
    slots.advance();
    return ok;
  }

  // The signaler (one thread of the producer warpgroup): signals each tile the consumers post,
  // in their order, until the exit item; leaves on a failed (aborted) wait, when the consumers
  // post nothing more.
  __device__ static void signaler(const Smem& sm, const GemmOperands& ops, const Epilogue& epi, const WaitContext& ctx) {
    RoleState* st = sm.state();
    auto slots = PipelineState<kTileSlots>::at(st->signal_take);
    const uint32_t m_blocks = (ops.m + BM - 1) / BM;
    const uint32_t n_blocks = (ops.n + BN - 1) / BN;
    for (;;) {
      if (!slots.wait_filled(sm.signal_full(slots.index), ctx, sm90::BarrierWhat::kSignalFull)) return;
      const WorkItem item = load_item(sm.signal_ring(slots.index));
      if (is_tile_kind_of<paired_epilogue<Epilogue>()>(item.kind)) {
        if constexpr (paired_epilogue<Epilogue>()) {
          const GemmOperands o = operands_of<true>(ops, item);  // the item's GEMM's shape
          epi.signal(item, (o.m + BM - 1) / BM, (o.n + BN - 1) / BN);
        } else {
          epi.signal(item, m_blocks, n_blocks);
        }
      }
      cuda::ptx::mbarrier_arrive(sm.signal_empty(slots.index));
      slots.advance();
      if (!is_tile_kind_of<paired_epilogue<Epilogue>()>(item.kind)) break;
    }
    st->signal_take = slots.position();
  }
};

}  // namespace loom::kernels::gemm
