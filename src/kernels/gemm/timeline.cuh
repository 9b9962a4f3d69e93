// The compute role's tile timeline (diagnostics): which record a work item writes and the claim
// and store timestamps. Separate from the role so that its hot loops show only the pointer test
// they pay when no timeline is given, and so that other kernels on the engine can record alike.
#pragma once

#include <cstdint>

#include "kernels/comm/wait.cuh"
#include "kernels/gemm/operands.cuh"
#include "kernels/gemm/params.h"
#include "loom/diagnostics.h"

namespace loom::kernels::gemm {

// A tile's record is at its tile index; a split tile's pieces follow all tiles, by piece slot,
// while they fit the buffer's tile_timeline_capacity (loom/diagnostics.h).
template <int BM, int BN>
struct TileTimeline {
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
  // A fold tile's fold (clock64 values): begun, its k-block drained, the previous signal posted,
  // and the partials added (now).
  __device__ static void record_fold(TileTimelineRecord& r, uint64_t begin, uint64_t drained, uint64_t signalled) {
    r.fold_cycles = static_cast<uint32_t>(clock64() - begin);
    r.fold_drain_cycles = static_cast<uint32_t>(drained - begin);
    r.fold_signal_cycles = static_cast<uint32_t>(signalled - drained);
  }
  __device__ static void record_stored(TileTimelineRecord& r) {
    r.stored_ns = global_timer_ns();
    r.stored_clock = clock64();
  }
};

}  // namespace loom::kernels::gemm
