// TileEpilogue: the GEMM engine's default epilogue (destination, store or reduce-add, signal),
// configured at run time by EpilogueParams (kernels/gemm/params.h) and one tensor map per
// destination. The compute role stages each consumer warp's accumulators as 16-row x 128-byte
// boxes in shared memory (128B-swizzled, the tensor maps say SWIZZLE_128B) and asks the epilogue
// to send each box; what leaves shared memory is TMA's, so M and N tails are clipped by the
// tensor map bounds.
//
// Interface any replacement must offer (the compute role is a template over it):
//   uint32_t out_dtype() const;                       // loom::DType of the staged boxes
//   void prefetch() const;                            // optional tensor-map prefetch (one thread)
//   void issue(const void* box, const WorkItem& tile, uint32_t row, uint32_t col) const;
//                                                     // lane 0 of a consumer warp: send the box of
//                                                     // `tile` whose top-left element is (row, col)
//   void write16(uint32_t row, uint32_t col, const uint4& v) const;  // only with a scheduler
//                                                     // that sets kRowRanges: 16 bytes of output at
//                                                     // (row, col), a generic store (the rows of a
//                                                     // box that crosses the tile's row limit)
//   bool signals() const;                             // does signal() need calling?
//   void signal(const WorkItem& tile, uint32_t m_blocks, uint32_t n_blocks) const;  // one thread,
//                                                     // after every box of the tile has landed
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/signals.cuh"
#include "kernels/common/sm90.cuh"
#include "kernels/gemm/params.h"

namespace loom::kernels::gemm {

template <int kBlockM>
class TileEpilogue {
 public:
  __device__ TileEpilogue(const EpilogueParams& params, const sm90::TmaDescriptor* dst_maps)
      : p_(params), maps_(dst_maps) {}

  __device__ uint32_t out_dtype() const { return p_.out_dtype; }
  __device__ bool signals() const { return p_.flags[0] != nullptr; }

  __device__ void prefetch() const {
    for (uint32_t d = 0; d < p_.num_dst; ++d) sm90::prefetch_tensormap(maps_ + d);
  }

  __device__ void issue(const void* box, const WorkItem& /*tile*/, uint32_t row, uint32_t col) const {
    uint32_t d = 0;
    int32_t local = static_cast<int32_t>(row);
    if (p_.num_dst > 1) {
      d = min(row / p_.rows_per_dst, p_.num_dst - 1);
      local = static_cast<int32_t>(row - d * p_.rows_per_dst);
    }
    // rows_per_dst is a multiple of kEpiRows (the launcher checks), so a box never straddles
    // two destinations.
    send(d, static_cast<int32_t>(col), local, box);
  }

  // Called by one thread (the compute role's signaler) once every box of `tile` is visible (each
  // consumer warp waited for its bulk groups, fenced, and arrived on the signal slot).
  __device__ void signal(const WorkItem& tile, uint32_t m_blocks, uint32_t n_blocks) const {
    uint32_t d = 0;
    uint32_t local_m = tile.m_block;
    if (p_.num_dst > 1) {
      const uint32_t m_blocks_per_dst = p_.rows_per_dst / kBlockM;  // launcher checks divisibility
      d = min(tile.m_block / m_blocks_per_dst, p_.num_dst - 1);
      local_m = tile.m_block - d * m_blocks_per_dst;
    }
    uint64_t* flags = p_.flags[d];
    if (flags == nullptr) return;
    __threadfence_system();
    if (p_.chunk_m_blocks == 0) {
      flag_store_release(flags + p_.flag_offset + local_m * n_blocks + tile.n_block, p_.epoch);
      return;
    }
    const uint32_t chunk = tile.m_block / p_.chunk_m_blocks;
    const uint32_t rows_in_chunk = min(m_blocks, (chunk + 1) * p_.chunk_m_blocks) - chunk * p_.chunk_m_blocks;
    const uint64_t target = p_.epoch * static_cast<uint64_t>(rows_in_chunk * n_blocks);
    const unsigned long long before =
        atomicAdd(reinterpret_cast<unsigned long long*>(p_.chunk_counters + chunk), 1ull);
    if (before + 1 == target) {
      __threadfence_system();  // the other tiles' publishers fenced before their increments
      flag_store_release(flags + p_.flag_offset + local_m / p_.chunk_m_blocks, p_.epoch);
    }
  }

 private:
  __device__ void send(uint32_t d, int32_t col, int32_t row, const void* box) const {
    const int32_t coords[2] = {col, row};
    if (p_.op == static_cast<uint32_t>(EpilogueOp::kReduceAdd)) {
      cuda::ptx::cp_reduce_async_bulk_tensor(cuda::ptx::space_global, cuda::ptx::space_shared, cuda::ptx::op_add,
                                             maps_ + d, coords, box);
    } else {
      cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_global, cuda::ptx::space_shared, maps_ + d, coords, box);
    }
  }

  const EpilogueParams& p_;
  const sm90::TmaDescriptor* maps_;
};

// A paired role's epilogue (operands.cuh, paired_epilogue): First for its kTile items, Second for
// its kTileSecond items; the role stages each item through its own policy.
template <class First, class Second>
class PairedEpilogue {
 public:
  static constexpr bool kPaired = true;
  __device__ PairedEpilogue(const First& first, const Second& second) : first_(first), second_(second) {}

  __device__ const First& first() const { return first_; }
  __device__ const Second& second() const { return second_; }
  __device__ bool signals() const { return first_.signals() || second_.signals(); }
  __device__ void prefetch() const {
    first_.prefetch();
    second_.prefetch();
  }
  __device__ void signal(const WorkItem& tile, uint32_t m_blocks, uint32_t n_blocks) const {
    if (tile.kind == static_cast<uint32_t>(WorkKind::kTileSecond)) {
      if (second_.signals()) second_.signal(tile, m_blocks, n_blocks);
    } else if (first_.signals()) {
      first_.signal(tile, m_blocks, n_blocks);
    }
  }

 private:
  First first_;
  Second second_;
};

}  // namespace loom::kernels::gemm
