// The fused tensor-parallel kernels' scheduling, as the GEMM engine's Tiles policy (TpTiles,
// kernels/gemm/scheduler.cuh explains the interface): arrival gates on A's rows (ag_gemm), the
// rank-banded order and the fold range (gemm_rs, gemm_ar). TpScheduler is the engine's
// TileScheduler with it and the tail split.
//
// Gate: with row_flags set, a tile waits (bounded) until every flag covering its A rows has
// reached the launch epoch; flag f covers A rows [f * rows_per_flag, (f + 1) * rows_per_flag).
// Rows in [ungated_begin, ungated_end) need no wait (this rank's own rows).
// Rank-banded order (order_world > 1, replaces the rotation): the tile rows are owned by
// order_world ranks, order_m_blocks_per_rank each, cut into bands of order_band_m_blocks. The
// order visits band 0 of owners self+offset, self+offset+1, ... (mod world, `order_world` owners),
// then band 1 of each, and so on: with offset 1 every rank computes the other ranks' rows of a
// band before its own, so the partial tiles it owes them leave early and the ones it is owed have
// arrived when its own rows come. Requires m_blocks == order_world * order_m_blocks_per_rank,
// divisible into bands (the launcher checks).
// Fold: tiles in tile rows [fold_m_begin, fold_m_end) are handed out as WorkKind::kTileFold.
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/signals.cuh"
#include "kernels/comm/wait.cuh"
#include "kernels/gemm/params.h"
#include "kernels/gemm/scheduler.cuh"
#include "kernels/gemm/tail_split.cuh"

namespace loom::kernels::tp {

struct TpSchedulerParams {
  const uint64_t* row_flags = nullptr;  // arrival flags (any memory the GPU can read), or null
  uint32_t rows_per_flag = 0;
  uint32_t rows_per_source = 0;  // rows each source rank contributes (error records name the rank)
  uint32_t ungated_begin = 0;
  uint32_t ungated_end = 0;
  uint32_t order_world = 0;      // > 1: rank-banded order (see above); 0 or 1: the rotation
  uint32_t order_self = 0;
  uint32_t order_owner_offset = 0;
  uint32_t order_m_blocks_per_rank = 0;
  uint32_t order_band_m_blocks = 0;
  uint32_t fold_m_begin = 0;     // tile rows handed out as kTileFold: [fold_m_begin, fold_m_end)
  uint32_t fold_m_end = 0;
};

template <int kBlockM>
class TpTiles {
 public:
  // epoch: what the gate's flags must reach (the launch epoch, read on the device).
  __device__ TpTiles(const TpSchedulerParams& params, uint64_t epoch) : p_(params), epoch_(epoch) {}

  __device__ uint32_t m_block(uint32_t r, const gemm::SchedulerParams& s) const {
    return p_.order_world > 1 ? banded_m_block(r) : gemm::rotated_m_block(r, s);
  }

  __device__ void place(gemm::WorkItem& item) const {
    if (item.m_block >= p_.fold_m_begin && item.m_block < p_.fold_m_end) {
      item.kind = static_cast<uint32_t>(gemm::WorkKind::kTileFold);
    }
  }

  // Waits for every arrival flag that covers the A rows of tile row m_block. Consecutive tiles
  // of one tile row share their flags, so the last range that passed is remembered.
  __device__ bool gate(uint32_t m_block, const gemm::SchedulerParams& s, const WaitContext& ctx) {
    if (p_.row_flags == nullptr) return true;
    const uint32_t row_lo = m_block * kBlockM;
    const uint32_t row_hi = min(row_lo + kBlockM, s.m_rows);  // exclusive
    const uint32_t f_lo = row_lo / p_.rows_per_flag;
    const uint32_t f_hi = (row_hi - 1) / p_.rows_per_flag;
    if (f_lo >= passed_lo_ && f_hi <= passed_hi_) return true;
    for (uint32_t f = f_lo; f <= f_hi; ++f) {
      const uint32_t flag_lo = f * p_.rows_per_flag;
      const uint32_t flag_hi = min(flag_lo + p_.rows_per_flag, s.m_rows);
      if (flag_lo >= p_.ungated_begin && flag_hi <= p_.ungated_end) continue;  // our own rows
      const int source = p_.rows_per_source != 0 ? static_cast<int>(flag_lo / p_.rows_per_source) : -1;
      if (!wait_flag(p_.row_flags + f, epoch_, ctx, source, FlagKind::kTile, f)) return false;
    }
    passed_lo_ = f_lo;
    passed_hi_ = f_hi;
    // The rows were written by other agents (generic proxy or copy engine) and are read next by
    // TMA (async proxy): order the flag acquire before those reads.
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
    return true;
  }

  // Position r of the rank-banded row order -> tile row.
  __device__ uint32_t banded_m_block(uint32_t r) const {
    const uint32_t band = p_.order_band_m_blocks;
    const uint32_t round_rows = band * p_.order_world;
    const uint32_t round = r / round_rows;
    const uint32_t in_round = r - round * round_rows;
    const uint32_t slot = in_round / band;
    const uint32_t owner = (p_.order_self + p_.order_owner_offset + slot) % p_.order_world;
    return owner * p_.order_m_blocks_per_rank + round * band + (in_round - slot * band);
  }

 private:
  const TpSchedulerParams& p_;
  uint64_t epoch_;
  uint32_t passed_lo_ = 1;  // flags [passed_lo_, passed_hi_] have reached the epoch
  uint32_t passed_hi_ = 0;
};

template <int kBlockM>
using TpScheduler = gemm::TileScheduler<TpTiles<kBlockM>, gemm::TailSplit>;

}  // namespace loom::kernels::tp
