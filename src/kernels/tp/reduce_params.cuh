// Kernel parameters and flag indices of the fused gemm_rs / gemm_ar kernels (the algorithm,
// buffers and flags are described in staged_reduce.cuh; the relay role in tile_relay.cuh).
#pragma once

#include <cstdint>

#include "kernels/common/sm90.cuh"
#include "kernels/gemm/params.h"
#include "kernels/tp/fused_frame.cuh"
#include "loom/diagnostics.h"

namespace loom::kernels::tp {

struct ReduceGemmParams {
  sm90::TmaDescriptor a;       // [M, K_r]
  sm90::TmaDescriptor b;
  sm90::TmaDescriptor staged;  // this rank's staging [(W-1) * M/W, N], box {64, BLOCK_M}: fold loads
  sm90::TmaDescriptor out[TpTunables::kMaxLocalWorld];       // gemm_rs: [0] = out [M/W, N];
                                                             // gemm_ar: [d] = rank d's out [M, N]; box {64, 16}
  sm90::TmaDescriptor stage_to[TpTunables::kMaxLocalWorld];  // [d] = rank d's staging (d != me), box {64, 16}
  // With relay CTAs (relay_ctas > 0; tile_relay.cuh) the epilogues store partials into this
  // rank's outbox (the staging's shape and slots) and the relays copy them out:
  sm90::TmaDescriptor outbox;       // outbox [(W-1) * M/W, N], box {64, 16}: epilogue stores
  sm90::TmaDescriptor outbox_rows;  // the same memory, box {64, BLOCK_M}: relay loads
  sm90::TmaDescriptor out_rows;     // gemm_ar: this rank's out [M, N], box {64, BLOCK_M}: relay loads
  DeviceComm comm;
  TpDeviceState* tp;
  uint32_t m, n, k;
  gemm::SchedulerParams sched;  // queue, rank-banded order (offset 1), fold range = our tile rows
  uint32_t rows_per_rank;       // M / W, a multiple of BLOCK_M
  uint32_t m_blocks_per_rank;
  uint32_t n_blocks;
  uint32_t out_dtype;           // loom::DType of out and the staging (= the input type)
  uint32_t signature;           // plan signature (fused_frame.cuh)
  uint32_t relay_ctas;          // CTAs [0, relay_ctas) relay (tile_relay.cuh); 0: the epilogues push
  TileTimelineRecord* timeline;  // optional (diagnostics), one record per tile
};
static_assert(sizeof(ReduceGemmParams) <= 4096, "the reduce kernels' parameters must fit the classic 4 KiB limit");

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

// ready[tile] (relay_ctas > 0): "this rank's compute CTA has stored the tile locally", written
// and read on this rank only; after gemm_ar's final[] (or gemm_rs's partial[]) flags.
template <bool kBroadcast>
__device__ __forceinline__ uint64_t ready_flag_index(const ReduceGemmParams& p, uint32_t tile) {
  const uint64_t own_tiles = static_cast<uint64_t>(p.m_blocks_per_rank) * p.n_blocks;
  const uint64_t finals = kBroadcast ? static_cast<uint64_t>(p.sched.m_blocks) * p.n_blocks : 0;
  return static_cast<uint64_t>(p.comm.local_world) + static_cast<uint64_t>(p.comm.local_world - 1) * own_tiles + finals +
         tile;
}

}  // namespace loom::kernels::tp
