// What the multi-node operators' persistent kernels (sm90_ag_gemm.cuh, sm90_reduce.cuh,
// transfer.cuh) add to the persistent-kernel frame (kernels/frame/): their roles, the
// bulk-copy stream of the data-moving roles (roles and tunables: layout.h, kernels/tp/tunables.h).
//
// One launch, on every rank (n, l), with launch epoch e (read on the device, CUDA-graph safe):
//   1. every CTA stores its NVLink entry word (entry_word(e, signature)) into every local peer's
//      network window (kernels/comm/net.cuh); the network-send CTA announces the entry to the
//      network peers that write into this rank;
//   2. before its first write into a peer (NVLink or network) a CTA waits, bounded, for that
//      peer's entry of epoch e with the same signature;
//   3. roles work; every wait is bounded; a CTA that fails skips to the end;
//   4. every CTA counts itself out (frame::LaunchFrame::finish).
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/bulk_copy.cuh"
#include "kernels/comm/epoch.cuh"
#include "kernels/comm/net.cuh"
#include "kernels/comm/signals.cuh"
#include "kernels/comm/wait.cuh"
#include "kernels/common/sm90.cuh"
#include "kernels/frame/persistent.cuh"
#include "kernels/tp/multinode/layout.h"
#include "kernels/tp/tunables.h"
#include "runtime/device_abi.h"

namespace loom::kernels::tp::multinode {

// The data-moving roles' bulk-copy stream (kernels/comm/bulk_copy.cuh), in the compute role's
// stage buffers.
using CopyStream = BulkCopyStream<TpTunables::kCopyStages, TpTunables::kCopyStageBytes>;

// One thread: copies [src, src + bytes) to heap offset `offset` of every local peer through
// `stream` — waiting, the first time for each peer q (bit q of `entered`), until it entered this
// launch with the same plan — then sets word `flag` of each peer's network window to this
// launch's epoch, after the data. False after a failed (recorded) wait.
__device__ __forceinline__ bool replicate_to_local_peers(const DeviceComm& c, uint32_t signature, uint64_t offset,
                                                            const char* src, uint64_t bytes, uint32_t flag,
                                                            uint32_t& entered, CopyStream& stream,
                                                            const WaitContext& ctx) {
  char* dsts[TpTunables::kMaxLocalWorld];
  int ndst = 0;
  for (int q = 0; q < c.local_world; ++q) {
    if (q == c.local_rank) continue;
    if ((entered & (1u << q)) == 0) {
      if (!wait_entry(c, nvlink_entry(c), q, ctx.epoch, signature, ctx)) return false;
      entered |= 1u << q;
    }
    dsts[ndst++] = reinterpret_cast<char*>(c.peer_heap_bases[q] + offset);
  }
  if (!stream.copy(dsts, ndst, src, bytes, ctx)) return false;
  __threadfence_system();
  for (int q = 0; q < c.local_world; ++q) {
    if (q != c.local_rank) flag_store_release(net_word_at(c, q, flag), ctx.epoch);
  }
  return true;
}

// Raster position `within` of a block of `m_blocks` tile rows x `n_blocks` tile columns, in
// groups of `group_m` tile rows (dividing m_blocks), columns fastest within a group's rows
// (the GEMM engine's L2-friendly order).
__device__ __forceinline__ void raster_in_block(uint32_t within, uint32_t m_blocks, uint32_t n_blocks, uint32_t group_m,
                                                uint32_t& m_in, uint32_t& n_block) {
  const uint32_t g = group_m == 0 ? 1u : group_m;
  const uint32_t per_group = g * n_blocks;
  const uint32_t group = within / per_group;
  const uint32_t local = within - group * per_group;
  const uint32_t rows = min(m_blocks - group * g, g);
  m_in = group * g + local % rows;
  n_block = local / rows;
}

}  // namespace loom::kernels::tp::multinode
