// TileScheduler: the GEMM engine's default scheduler (order, claim, gate), configured at run
// time by SchedulerParams (kernels/gemm/params.h explains each field).
//
// A scheduler is called by exactly one thread per compute CTA: the producer's elected thread.
// Interface any replacement must offer (the compute role is a template over it):
//   WorkItem next(uint32_t compute_index, uint32_t num_compute, const WaitContext& ctx);
// returning kTile (kTileFold in the fold range; kTilePiece / kTileFold for the pieces of a split
// tile) only once the tile's inputs may be loaded (any gate passed; a fold tile's staged partials
// are waited for by the role's Fold policy), kDone when no
// work is left, kYield to hand the CTA back to its caller between tiles, kFailed after a bounded
// wait failed (the failure already recorded by the wait).
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/signals.cuh"
#include "kernels/comm/wait.cuh"
#include "kernels/gemm/params.h"

namespace loom::kernels::gemm {

template <int kBlockM>
class TileScheduler {
 public:
  __device__ explicit TileScheduler(const SchedulerParams& params) : p_(params), epoch_(params.epoch) {}
  // Fused kernels read their launch epoch on the device (CUDA-graph safe) and gate on it
  // instead of params.epoch.
  __device__ TileScheduler(const SchedulerParams& params, uint64_t epoch) : p_(params), epoch_(epoch) {}

  __device__ WorkItem next(uint32_t compute_index, uint32_t num_compute, const WaitContext& ctx) {
    if (p_.compute_limit != nullptr) {
      const uint32_t limit = *reinterpret_cast<const volatile uint32_t*>(p_.compute_limit);
      if (compute_index >= limit) return WorkItem{static_cast<uint32_t>(WorkKind::kYield), 0, 0, 0};
    }
    const uint32_t total = p_.m_blocks * p_.n_blocks;
    const uint32_t pieces = p_.split_pieces >= 2 ? p_.split_pieces : 1u;
    const uint32_t whole = total - (pieces > 1 ? p_.split_tiles : 0u);  // tiles handed out whole
    const uint32_t work = whole + (total - whole) * pieces;
    uint32_t w;
    if (p_.queue != nullptr) {
      w = atomicAdd(p_.queue, 1u);
    } else {
      w = compute_index + claimed_ * num_compute;
      if (w < work) ++claimed_;
    }
    if (w >= work) return WorkItem{static_cast<uint32_t>(WorkKind::kDone), 0, 0, 0};

    // Work item w -> position t of the order (and the part of a split tile). The split tiles go
    // part by part: every tile's part 0, then every tile's part 1, ...: items running side by
    // side read the same K range of neighbouring tiles (L2 reuse, as whole tiles in a raster
    // group do), and every fold item (a tile's last part) comes after every piece, so a fold
    // never waits for a piece that is queued behind it (pieces wait for nothing).
    const bool split = w >= whole;
    const uint32_t split_tiles = total - whole;
    const uint32_t part = split ? (w - whole) / split_tiles : 0;
    const uint32_t tail_index = split ? (w - whole) - part * split_tiles : 0;
    const uint32_t t = split ? whole + tail_index : w;

    uint32_t m_block, n_block;
    tile_at(t, m_block, n_block);
    if (p_.row_flags != nullptr && !gate(m_block, ctx)) {
      return WorkItem{static_cast<uint32_t>(WorkKind::kFailed), 0, 0, 0};
    }
    const uint32_t tile = m_block * p_.n_blocks + n_block;
    if (p_.trace != nullptr) p_.trace[tile] = global_timer_ns();
    const bool fold = m_block >= p_.fold_m_begin && m_block < p_.fold_m_end;
    WorkItem item{static_cast<uint32_t>(fold ? WorkKind::kTileFold : WorkKind::kTile), m_block, n_block, tile};
    if (split) {
      // Parts 0 .. pieces-2 are the pieces (K ranges 1, 2, ...), the last part the fold item (K
      // range 0), which adds them.
      const bool folds = part == pieces - 1;
      const uint32_t range = folds ? 0 : part + 1;
      item.k_begin = range * p_.k_blocks / pieces;
      item.k_end = (range + 1) * p_.k_blocks / pieces;
      item.split_slot = tail_index * (pieces - 1) + (folds ? 0 : part);
      item.split_count = folds ? pieces - 1 : 0;
      item.kind = static_cast<uint32_t>(folds ? WorkKind::kTileFold : WorkKind::kTilePiece);
    }
    return item;
  }

  // Position t of the order -> (m_block, n_block): grouped raster, rotated by m_block_start.
  __device__ void tile_at(uint32_t t, uint32_t& m_block, uint32_t& n_block) const {
    const uint32_t group_m = p_.group_m == 0 ? 1u : p_.group_m;
    const uint32_t per_group = group_m * p_.n_blocks;
    const uint32_t group = t / per_group;
    const uint32_t first_m = group * group_m;
    const uint32_t rows = min(p_.m_blocks - first_m, group_m);
    const uint32_t local = t - group * per_group;
    const uint32_t m_rot = first_m + local % rows;
    n_block = local / rows;
    if (p_.order_world > 1) {
      m_block = banded_m_block(m_rot);
      return;
    }
    m_block = m_rot + p_.m_block_start;
    if (m_block >= p_.m_blocks) m_block -= p_.m_blocks;
  }

  // Position i of the rank-banded row order -> tile row (SchedulerParams explains the order).
  __device__ uint32_t banded_m_block(uint32_t i) const {
    const uint32_t band = p_.order_band_m_blocks;
    const uint32_t round_rows = band * p_.order_world;
    const uint32_t round = i / round_rows;
    const uint32_t in_round = i - round * round_rows;
    const uint32_t slot = in_round / band;
    const uint32_t owner = (p_.order_self + p_.order_owner_offset + slot) % p_.order_world;
    return owner * p_.order_m_blocks_per_rank + round * band + (in_round - slot * band);
  }

 private:
  // Waits for every arrival flag that covers the A rows of tile row m_block. Consecutive tiles
  // of one tile row share their flags, so the last range that passed is remembered.
  __device__ bool gate(uint32_t m_block, const WaitContext& ctx) {
    const uint32_t row_lo = m_block * kBlockM;
    const uint32_t row_hi = min(row_lo + kBlockM, p_.m_rows);  // exclusive
    const uint32_t f_lo = row_lo / p_.rows_per_flag;
    const uint32_t f_hi = (row_hi - 1) / p_.rows_per_flag;
    if (f_lo >= passed_lo_ && f_hi <= passed_hi_) return true;
    for (uint32_t f = f_lo; f <= f_hi; ++f) {
      const uint32_t flag_lo = f * p_.rows_per_flag;
      const uint32_t flag_hi = min(flag_lo + p_.rows_per_flag, p_.m_rows);
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

  const SchedulerParams& p_;
  uint64_t epoch_;              // what the gate's flags must reach
  uint32_t claimed_ = 0;        // static claim: tiles taken so far (persists across run() calls)
  uint32_t passed_lo_ = 1;      // flags [passed_lo_, passed_hi_] have reached the epoch
  uint32_t passed_hi_ = 0;
};

}  // namespace loom::kernels::gemm
