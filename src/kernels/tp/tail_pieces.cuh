// The piece slots of a fused kernel's tail split (gemm/tail_split.cuh, TailSplitParams),
// shared by ag_gemm and gemm_rs / gemm_ar: a kTilePiece item's epilogue TMA-stores its rounded
// 16-bit partial into slot `split_slot` of this rank's slots and, once the writes have landed,
// the signaler sets piece[slot] = e; the tile's fold item waits for its pieces' flags and loads
// them through `load` (ComputeRole's Fold::piece_map). Local only: no peer reads them.
//
// Slots: [slots * BM, BN] of the input type in the TP workspace, slot s = rows [s BM, (s+1) BM).
// Flags: op_flags[flag_base + slot] of this rank (after the operator's other launch flags).
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/common/sm90.cuh"
#include "kernels/gemm/params.h"
#include "kernels/tp/flags.h"
#include "kernels/tp/fused_frame.cuh"

namespace loom::kernels::tp {

struct TailPieces {
  sm90::TmaDescriptor store;  // box {64, 16}: piece epilogues
  sm90::TmaDescriptor load;   // box {64, BLOCK_M}: fold loads
  uint32_t flag_base;         // op_flags index of piece[0] (meaningful only with a tail split)

  // Lane 0 of a consumer warp: the 16 x 64 box of piece `tile` whose top-left element is (row, col).
  template <int kBlockM, int kBlockN>
  __device__ void store_box(const void* box, const gemm::WorkItem& tile, uint32_t row, uint32_t col) const {
    const int32_t coords[2] = {static_cast<int32_t>(col - tile.n_block * kBlockN),
                               static_cast<int32_t>(tile.split_slot * kBlockM + (row - tile.m_block * kBlockM))};
    cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_global, cuda::ptx::space_shared, &store, coords, box);
  }

  // The signaler, once the piece's writes have landed.
  __device__ void signal(const DeviceComm& c, const gemm::WorkItem& tile, uint64_t epoch) const {
    __threadfence();  // a CTA of this GPU reads the piece next
    flag_store_release(op_flag(c, c.local_rank, flag_base + tile.split_slot), epoch);
  }

  // Producer thread of the fold item: every piece of `tile` is staged (bounded waits). The
  // caller fences the proxies before TMA reads the pieces.
  __device__ bool wait(const DeviceComm& c, const gemm::WorkItem& tile, uint64_t epoch, const WaitContext& ctx) const {
    for (uint32_t i = 0; i < tile.split_count; ++i) {
      const uint32_t slot = tile.split_slot + i;
      if (!wait_flag(op_flag(c, c.local_rank, flag_base + slot), epoch, ctx, c.local_rank, kPieceFlag, slot)) {
        return false;
      }
    }
    return true;
  }
};

}  // namespace loom::kernels::tp
