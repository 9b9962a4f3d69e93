// What the multi-node operators' persistent kernels (multinode_ag_gemm.cuh, multinode_reduce.cuh,
// multinode_transfer.cuh) add to the persistent-kernel frame (kernels/frame/): their roles, the
// bulk-copy stream of the data-moving roles, and the tunables.
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
#include "kernels/frame/role_table.h"
#include "kernels/tp/multinode_layout.h"
#include "runtime/device_abi.h"

namespace loom::kernels::tp::mn {

struct MnTunables {
  // GPUs per node a multi-node kernel addresses over NVLink (per-local-rank tensor maps live in
  // the kernel parameters); L itself is a run-time value.
  static constexpr int kMaxLocalWorld = 8;
  // The data-moving roles copy through a ring of TMA bulk loads and stores driven by one thread:
  // kCopyStages pieces of kCopyStageBytes in flight (128 KiB), in the compute role's stage
  // buffers, which are free until the CTA joins the compute role.
  static constexpr int kCopyStages = 8;
  static constexpr uint32_t kCopyStageBytes = 16 * 1024;
  // CTAs of the roles that exist only with L > 1 (the network rate is ~1/8 of NVLink's, so a few
  // CTAs replicate what arrives to L - 1 peers).
  static constexpr uint32_t kMaxNetRecvCtas = 4;
  static constexpr uint32_t kNvlinkCtas = 2;
};

// Roles a CTA takes, from the role table (never from bare index arithmetic).
enum class MultiNodeRole : uint32_t {
  kNetSend = 0,  // pushes network commands (own data, forwards, reduced partials); entry announcer
  kNetRecv = 1,  // waits for network arrivals and replicates them to the local peers over NVLink
  kNvlink = 2,   // pushes this rank's own data to the local peers over NVLink
  kCompute = 3,  // the GEMM engine's compute role on tiles from the launch's queue
};

// CTAs [0, net_send) send, then [.., + net_recv) receive, then [.., + nvlink) NVLink, the rest
// compute (kernels/frame/role_table.h). Roles other than kNetSend join the compute role when
// their items are done (ag_gemm); the reduce kernels' kNetSend works for the whole launch.
using MultiNodeRoleTable = frame::RoleTable<MultiNodeRole, MultiNodeRole::kCompute>;

// The data-moving roles' bulk-copy stream (kernels/comm/bulk_copy.cuh), in the compute role's
// stage buffers.
using MnStream = BulkCopyStream<MnTunables::kCopyStages, MnTunables::kCopyStageBytes>;

// One thread: copies [src, src + bytes) to heap offset `offset` of every local peer through
// `stream` — waiting, the first time for each peer q (bit q of `entered`), until it entered this
// launch with the same plan — then sets word `flag` of each peer's network window to this
// launch's epoch, after the data. False after a failed (recorded) wait.
__device__ __forceinline__ bool mn_replicate_to_local_peers(const DeviceComm& c, uint32_t signature, uint64_t offset,
                                                            const char* src, uint64_t bytes, uint32_t flag,
                                                            uint32_t& entered, MnStream& stream,
                                                            const WaitContext& ctx) {
  char* dsts[MnTunables::kMaxLocalWorld];
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

}  // namespace loom::kernels::tp::mn
