// Grouped GEMM for a MoE layer's experts: D_e = A_e * B_e^T for every expert e, on the GEMM engine
// (kernels/gemm/compute_role.cuh) with one scheduler policy, GroupedTiles, and no padding of A.
//
//   A  rows of all experts (kernels/moe/grouped_gemm_params.h: contiguous [M_total, K] with
//      device offsets, or masked [E, capacity, K] with device counts), bf16 or fp16
//   B  [E, N, K] (one nn.Linear weight per expert), read through a 3-D tensor map at (e, n0, k0)
//   D  the rows of A, [.., N], bf16, fp16 or fp32; fp32 accumulation
//
// Two kernels, in stream order, no host synchronization:
//   grouped_gemm_plan_kernel   one CTA: each expert's rows -> ceil(count / BLOCK_M) tile rows,
//                              scanned over the experts into the workspace's table (expert, first
//                              row, row limit per tile row) and its total T.
//   sm90_grouped_gemm_kernel   the persistent GEMM: the engine's TileScheduler over T x n_blocks
//                              tiles (T read from the workspace on the device), GroupedTiles
//                              turning tile row r into table[r]. Work units are tiles of equal
//                              cost, claimed round-robin, so any distribution of rows over the
//                              experts balances (each expert wastes less than one tile row).
// A tile's loads may read rows past its expert's end (the next expert's, or TMA's zero fill past
// A); its stores stop at the expert's end (the engine's row ranges: a box crossing the end is
// written row by row with generic stores), so rows outside every expert are never written.
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/wait.cuh"
#include "kernels/common/sm90.cuh"
#include "kernels/common/warp_scan.cuh"
#include "kernels/gemm/compute_role.cuh"
#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/params.h"
#include "kernels/gemm/scheduler.cuh"
#include "kernels/moe/grouped_gemm_params.h"
#include "runtime/device_abi.h"

namespace loom::kernels::moe {

// ---- plan kernel ---------------------------------------------------------------------------------

// Launched with one CTA of kThreads threads. Experts are taken kThreads at a time: thread i owns
// expert base + i, a block-wide exclusive scan of the tile-row counts gives each its first tile
// row, and all threads then fill the chunk's table entries (each entry finds its expert by a
// binary search over the chunk's starts, so one expert with all the rows is filled in parallel).
template <int kThreads>
__global__ void __launch_bounds__(kThreads) grouped_gemm_plan_kernel(const GroupedPlanParams p) {
  constexpr int kWarps = kThreads / 32;
  static_assert(kThreads % 32 == 0 && kWarps <= 32, "the scan over the warps' sums runs in one warp");
  // Tile-row counts are summed in 64 bits: malformed (overlapping) offsets can add up to E times
  // M_total rows; only the first max_tile_rows entries are ever written.
  __shared__ uint64_t warp_sums[kWarps];
  __shared__ uint64_t start[kThreads];  // first tile row of each expert of the chunk (absolute)
  __shared__ uint32_t first_row[kThreads];
  __shared__ uint32_t row_limit[kThreads];
  __shared__ uint32_t clamped;
  const uint32_t tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  if (tid == 0) clamped = 0;
  uint64_t carry = 0;  // tile rows of the chunks before this one
  uint32_t my_clamped = 0;
  for (uint32_t base = 0; base < p.experts; base += kThreads) {
    const uint32_t e = base + tid;
    uint32_t first = 0, count = 0;
    if (e < p.experts) {
      const int64_t rows = p.rows;
      if (p.layout == static_cast<uint32_t>(GroupedRows::kContiguous)) {
        // Clamped into [0, M_total] so that malformed offsets never address rows outside A and D.
        const int64_t lo = p.offsets[e], hi = p.offsets[e + 1];
        if (lo < 0 || hi < lo || hi > rows) ++my_clamped;
        const int64_t lo_c = lo < 0 ? 0 : (lo > rows ? rows : lo);
        const int64_t hi_c = hi < lo_c ? lo_c : (hi > rows ? rows : hi);
        first = static_cast<uint32_t>(lo_c);
        count = static_cast<uint32_t>(hi_c - lo_c);
      } else {
        const int64_t c = p.counts[e];
        if (c < 0 || c > rows) ++my_clamped;
        first = e * p.rows;
        count = static_cast<uint32_t>(c < 0 ? 0 : (c > rows ? rows : c));
      }
    }
    const uint64_t blocks = (count + p.block_m - 1) / p.block_m;

    // Inclusive scan of `blocks` within the warp, then over the warps' sums.
    uint64_t incl = warp_inclusive_sum(blocks);
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      const uint64_t s = warp_inclusive_sum(lane < static_cast<uint32_t>(kWarps) ? warp_sums[lane] : uint64_t{0});
      if (lane < static_cast<uint32_t>(kWarps)) warp_sums[lane] = s;
    }
    __syncthreads();
    incl += warp > 0 ? warp_sums[warp - 1] : 0;
    const uint64_t chunk_rows = warp_sums[kWarps - 1];
    start[tid] = carry + incl - blocks;
    first_row[tid] = first;
    row_limit[tid] = first + count;
    __syncthreads();

    // Table entries of the chunk: entry t belongs to the last expert whose start is <= t (experts
    // without rows share their start with the next one and are skipped by "last").
    const uint64_t chunk_end = carry + chunk_rows < p.max_tile_rows ? carry + chunk_rows : p.max_tile_rows;
    for (uint64_t t = carry + tid; t < chunk_end; t += kThreads) {
      uint32_t lo = 0, hi = kThreads - 1;
      while (lo < hi) {
        const uint32_t mid = (lo + hi + 1) / 2;
        if (start[mid] <= t) lo = mid;
        else hi = mid - 1;
      }
      GroupedTileRow row;
      const uint32_t k = static_cast<uint32_t>(t - start[lo]);  // the expert's k-th tile row
      row.expert = base + lo;
      row.row_first = first_row[lo] + k * p.block_m;
      row.row_limit = row_limit[lo];
      const uint32_t expert_rows = (row_limit[lo] - first_row[lo] + p.block_m - 1) / p.block_m;
      row.group = expert_group_of(k, expert_rows, p.group_rows);
      p.table[t] = row;
    }
    carry += chunk_rows;
    __syncthreads();  // the next chunk rewrites the shared arrays
  }
  if (my_clamped != 0) atomicAdd(&clamped, my_clamped);
  __syncthreads();
  if (tid == 0) {
    p.header->tile_rows = static_cast<uint32_t>(carry < p.max_tile_rows ? carry : p.max_tile_rows);
    p.header->clamped_experts = clamped;
    p.header->tile_queue = 0;
  }
}

// ---- the GEMM kernel -------------------------------------------------------------------------------

// The Tiles policy (kernels/gemm/scheduler.cuh): raster row r is tile row r of the table; placing
// a tile reads its expert and row range (one 16-byte load by the scheduling thread). With
// expert_groups, the raster's groups are the table's expert groups instead of group_m tile rows
// regardless of the experts: no group holds two experts' rows, so no expert's B is loaded by two
// groups unless it has more than group_m tile rows.
struct GroupedTiles {
  static constexpr bool kGroupedB = true;
  static constexpr bool kRowRanges = true;

  const GroupedTileRow* table;
  uint32_t expert_groups;  // GroupedGemmOptions::expert_groups

  // expert_group_tile (grouped_gemm_params.h): position t's group holds tile row t / n_blocks.
  __device__ bool order(uint32_t t, const gemm::SchedulerParams& p, uint32_t& m_block, uint32_t& n_block) const {
    if (expert_groups == 0) return false;
    const GroupedTile tile = expert_group_tile(t, p.n_blocks, table[t / p.n_blocks].group);
    m_block = tile.m_block;
    n_block = tile.n_block;
    return true;
  }

  __device__ uint32_t m_block(uint32_t r, const gemm::SchedulerParams& /*p*/) const { return r; }
  __device__ bool gate(uint32_t /*m_block*/, const gemm::SchedulerParams& /*p*/, const WaitContext& /*ctx*/) {
    return true;
  }
  __device__ void place(gemm::WorkItem& item) const {
    const uint4 row = *reinterpret_cast<const uint4*>(table + item.m_block);
    item.group = row.x;
    item.row_first = row.y;
    item.row_limit = row.z;
  }
};

// The engine's TileEpilogue (TMA stores into one destination) plus the generic 16-byte stores of
// the rows of a box that crosses an expert's end (EpilogueStage with row ranges). kGated: the
// SwiGLU epilogue (EpilogueStage's gated pairs; D has N / 2 columns).
template <int kBlockM, bool kGated>
class GroupedEpilogue : public gemm::TileEpilogue<kBlockM> {
 public:
  static constexpr bool kGatedPairs = kGated;
  __device__ GroupedEpilogue(const gemm::EpilogueParams& params, const sm90::TmaDescriptor* dst_map, uint8_t* d,
                             uint64_t ld_bytes)
      : gemm::TileEpilogue<kBlockM>(params, dst_map),
        d_(d),
        ld_bytes_(ld_bytes),
        elem_bytes_(params.out_dtype == 2u ? 4u : 2u) {}

  __device__ void write16(uint32_t row, uint32_t col, const uint4& v) const {
    *reinterpret_cast<uint4*>(d_ + row * ld_bytes_ + static_cast<uint64_t>(col) * elem_bytes_) = v;
  }

 private:
  uint8_t* d_;
  uint64_t ld_bytes_;
  uint32_t elem_bytes_;
};

// Kernel parameters (a __grid_constant__: the tensor maps need a stable address).
struct GroupedGemmKernelParams {
  sm90::TmaDescriptor a;       // rows of A: [rows, K], box {64, BLOCK_M}
  sm90::TmaDescriptor a_rows;  // the same rows, box {64, kTailRowBox}: partial tile rows (GemmOperands::a_rows)
  sm90::TmaDescriptor b;       // [E, N, K], box {64, BLOCK_N, 1}
  sm90::TmaDescriptor d;       // [rows, N] (SwiGLU: [rows, N / 2]), box {128 bytes, 16}
  uint32_t m, n, k;       // m: rows of A and D (M_total, or E * capacity)
  gemm::SchedulerParams sched;  // n_blocks, group_m set by the host; m_blocks read from the workspace
  gemm::EpilogueParams epi;
  WaitParams wait;
  GroupedWorkspaceHeader* header;  // tile_rows read; tile_queue counted up when tile_queue != 0
  const GroupedTileRow* table;
  uint8_t* d_ptr;         // D itself, for the rows written without TMA
  uint64_t ldd_bytes;
  uint32_t swap_tails;    // GroupedGemmOptions::swap_tails
  uint32_t tile_queue;    // GroupedGemmOptions::tile_queue: claim from header->tile_queue
  uint32_t expert_groups; // GroupedGemmOptions::expert_groups: the raster's groups from the table
};

// kBNMajor: B is [E, K, N] (each expert's B N-major) rather than [E, N, K]. kGated: the SwiGLU
// epilogue.
template <class Cfg, bool kBF16, bool kBNMajor, bool kGated>
using GroupedRole = gemm::ComputeRole<Cfg, kBF16, kBNMajor, gemm::TileScheduler<GroupedTiles>,
                                      GroupedEpilogue<Cfg::kBlockM, kGated>>;

template <class Cfg, bool kBF16, bool kBNMajor, bool kGated>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    sm90_grouped_gemm_kernel(const __grid_constant__ GroupedGemmKernelParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  using Role = GroupedRole<Cfg, kBF16, kBNMajor, kGated>;
  static_assert(gemm::TileScheduler<GroupedTiles>::kGroupedB && gemm::TileScheduler<GroupedTiles>::kRowRanges,
                "the grouped GEMM's scheduler must hand out each tile's expert and row range");
  const WaitContext ctx = WaitContext::start(p.wait, OpId::kGemm, 0);
  Role::init(smem);
  gemm::SchedulerParams sched = p.sched;
  sched.m_blocks = p.header->tile_rows;  // written by the plan kernel just before, in stream order
  if (p.tile_queue != 0) sched.queue = &p.header->tile_queue;
  gemm::TileScheduler<GroupedTiles> scheduler(sched, GroupedTiles{p.table, p.expert_groups});
  GroupedEpilogue<Cfg::kBlockM, kGated> epi(p.epi, &p.d, p.d_ptr, p.ldd_bytes);
  gemm::GemmOperands ops{&p.a, &p.b, p.m, p.n, p.k};
  ops.swap_tails = p.swap_tails != 0;
  ops.a_rows = &p.a_rows;
  (void)Role::run(smem, ops, scheduler, epi, blockIdx.x, gridDim.x, ctx);
}

}  // namespace loom::kernels::moe
