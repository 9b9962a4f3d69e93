// Multi-node AllGather + GEMM: out[M, N] = AllGather_rows(a_r[M/W, K]) @ b_r over N nodes x L GPUs,
// one persistent kernel. Rank (n, l) owns row block d = n L + l (layout.h, AgLayout).
//
// Roles (RoleTable):
//   kNetSend  one CTA. Announces the entry to the ring predecessor. Then, chunk by chunk (about
//             1 MiB of rows, one flag each): copies the shard into its rows of the gathered A
//             when they are not already there (TMA; the proxy reads the heap), and pushes a
//             network write of the chunk to the same-index GPU of the successor node, flag
//             row[d][c] on it. For N > 2 it then forwards, chunk by chunk as each arrives, the
//             blocks of nodes n - 1, ..., n - N + 2 (a ring: every GPU sends N - 1 blocks and
//             never fans out; N = 2 is the direct exchange). Then it computes, and at the end
//             waits until the proxy has completed its commands (the rows it sends are read
//             asynchronously; the next launch overwrites them).
//   kNetRecv  L > 1: waits for each chunk of the blocks (s, l) arriving over the network and
//             replicates it to the L - 1 local peers (one TMA load, L - 1 stores), flag row[d][c]
//             on each. Then it computes.
//   kNvlink   L > 1: pushes the shard to the local peers' gathered A (flag row[own][c] on each),
//             as the single-node kernel does. Then it computes.
//   kCompute  the GEMM engine's ComputeRole with AgScheduler: tiles from the launch's queue,
//             this rank's block first (read straight from the shard, waits for nothing), then the
//             node's other blocks, then the other nodes' blocks in the order the ring delivers
//             them; a tile waits (bounded) for the flag of the chunk holding its rows.
//
// Buffers (heap offsets equal on every rank):
//   gathered A  [M, K] symmetric (the user's gathered_a or the multi-node workspace)
//   flags       row[d][c] in the network window (AgLayout::row_flag)
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/net.cuh"
#include "kernels/common/sm90.cuh"
#include "kernels/gemm/compute_role.cuh"
#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/params.h"
#include "kernels/tp/multinode/frame.cuh"
#include "kernels/tp/multinode/layout.h"

namespace loom::kernels::tp::multinode {

struct AgParams {
  sm90::TmaDescriptor a_gathered;  // [M, K] gathered A in this rank's heap, box {64, BLOCK_M}
  sm90::TmaDescriptor a_local;     // [R, K] this rank's shard, box {64, BLOCK_M}
  sm90::TmaDescriptor b;
  sm90::TmaDescriptor out;         // [M, N], box {64, 16}
  DeviceComm comm;
  LaunchState* state;
  uint32_t m, n, k;
  uint32_t n_blocks;               // ceil(N / BLOCK_N)
  uint32_t group_m;                // raster group height in tile rows, dividing R / BLOCK_M
  AgLayout layout;
  gemm::EpilogueParams epi;        // one destination (out), no signals
  const char* shard;               // this rank's a [R, K] (device memory of this GPU)
  uint64_t gathered_offset;        // heap offset of the gathered A
  uint64_t row_bytes;              // K * element size (a multiple of 16)
  uint32_t copy_own;               // 1: copy the shard into this rank's rows of the gathered A
  uint32_t signature;              // plan signature (entry words)
  RoleTable roles;
};
static_assert(sizeof(AgParams) <= 4096, "the multi-node ag_gemm parameters must fit the classic 4 KiB limit");

// Bytes of chunk `c` of block `d` start at gathered_offset + row_offset(d, c) in every heap.
__device__ __forceinline__ uint64_t ag_chunk_offset(const AgParams& p, uint32_t d, uint32_t c) {
  const uint64_t row = static_cast<uint64_t>(d) * p.layout.rows_per_block + static_cast<uint64_t>(c) * p.layout.rows_per_chunk;
  return p.gathered_offset + row * p.row_bytes;
}

__device__ __forceinline__ uint64_t ag_chunk_bytes(const AgParams& p) {
  return static_cast<uint64_t>(p.layout.rows_per_chunk) * p.row_bytes;
}

// kNetSend (thread 0).
__device__ __forceinline__ bool ag_net_send(const AgParams& p, CopyStream& stream, const WaitContext& ctx) {
  const DeviceComm& c = p.comm;
  const AgLayout& L = p.layout;
  const Grid& g = L.g;
  if (!announce_network_entry(c, EntryPeers::kRingPredecessor, p.signature, ctx)) return false;
  const int successor = net_rank_of(c, static_cast<int>(g.successor()), c.local_rank);
  const int predecessor = net_rank_of(c, static_cast<int>(g.predecessor()), c.local_rank);
  const uint32_t cpb = L.chunks_per_block();
  const uint64_t bytes = ag_chunk_bytes(p);
  bool entered = false;
  for (uint32_t k = 0; k < L.sends(); ++k) {
    const uint32_t d = L.send_block(k);
    const uint32_t chunk = k % cpb;
    const uint64_t offset = ag_chunk_offset(p, d, chunk);
    if (L.send_hop(k) == 0) {
      if (p.copy_own != 0) {
        char* dst = reinterpret_cast<char*>(c.local_heap_base + offset);
        if (!stream.copy(&dst, 1, p.shard + static_cast<uint64_t>(chunk) * bytes, bytes, ctx)) return false;
        __threadfence_system();  // the transport reads these rows from this heap
      }
    } else if (!net_wait(c, L.row_flag(d, chunk), predecessor, ctx)) {
      return false;
    }
    if (!entered) {
      if (!wait_network_entry(c, static_cast<int>(g.successor()), p.signature, ctx)) return false;
      entered = true;
    }
    if (!net_put(c, k, successor, offset, offset, bytes, L.row_flag(d, chunk), ctx)) return false;
  }
  return true;
}

// kNetRecv (thread 0): replicate network arrivals to the local peers.
__device__ __forceinline__ bool ag_net_recv(const AgParams& p, uint32_t index, uint32_t count, CopyStream& stream,
                                            const WaitContext& ctx) {
  const DeviceComm& c = p.comm;
  const AgLayout& L = p.layout;
  const int predecessor = net_rank_of(c, static_cast<int>(L.g.predecessor()), c.local_rank);
  const uint32_t cpb = L.chunks_per_block();
  const uint64_t bytes = ag_chunk_bytes(p);
  uint32_t entered = 0;  // bit q: local peer q has entered (L <= kMaxLocalWorld)
  for (uint32_t k = index; k < L.replications(); k += count) {
    const uint32_t d = L.replication_block(k);
    const uint32_t chunk = k % cpb;
    const uint32_t flag = L.row_flag(d, chunk);
    if (!net_wait(c, flag, predecessor, ctx)) return false;
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);  // the TMA loads below read what the network wrote
    const uint64_t offset = ag_chunk_offset(p, d, chunk);
    if (!replicate_to_local_peers(c, p.signature, offset, reinterpret_cast<const char*>(c.local_heap_base + offset), bytes,
                                     flag, entered, stream, ctx)) {
      return false;
    }
  }
  return true;
}

// kNvlink (thread 0): this rank's shard to every local peer.
__device__ __forceinline__ bool ag_nvlink_push(const AgParams& p, uint32_t index, uint32_t count, CopyStream& stream,
                                               const WaitContext& ctx) {
  const DeviceComm& c = p.comm;
  const AgLayout& L = p.layout;
  const uint32_t own = L.g.own_block();
  const uint64_t bytes = ag_chunk_bytes(p);
  uint32_t entered = 0;
  for (uint32_t chunk = index; chunk < L.chunks_per_block(); chunk += count) {
    if (!replicate_to_local_peers(c, p.signature, ag_chunk_offset(p, own, chunk),
                                     p.shard + static_cast<uint64_t>(chunk) * bytes, bytes, L.row_flag(own, chunk), entered,
                                     stream, ctx)) {
      return false;
    }
  }
  return true;
}

// The compute role's scheduler (GEMM engine interface: next()): the launch's queue in
// AgLayout::block_at order, each block rastered in groups of group_m tile rows; every tile of a
// block other than ours waits for its chunk's flag.
template <int kTileM>
class AgScheduler {
 public:
  static_assert(kTileM == static_cast<int>(kBlockM), "the multi-node layouts assume 128-row tiles");
  __device__ AgScheduler(const AgParams& p, uint64_t epoch) : p_(p), epoch_(epoch) {}

  __device__ gemm::WorkItem next(uint32_t /*compute_index*/, uint32_t /*num_compute*/, const WaitContext& ctx) {
    const AgLayout& L = p_.layout;
    const uint32_t m_blocks = L.rows_per_block / kTileM;
    const uint32_t per_block = m_blocks * p_.n_blocks;
    const uint32_t t = atomicAdd(&p_.state->tile_queue, 1u);
    if (t >= L.g.world() * per_block) return gemm::WorkItem{static_cast<uint32_t>(gemm::WorkKind::kDone), 0, 0, 0};
    const uint32_t d = L.block_at(t / per_block);
    uint32_t m_in = 0, n_block = 0;
    raster_in_block(t % per_block, m_blocks, p_.n_blocks, p_.group_m, m_in, n_block);
    if (d != L.g.own_block() && !gate(d, (m_in * kTileM) / L.rows_per_chunk, ctx)) {
      return gemm::WorkItem{static_cast<uint32_t>(gemm::WorkKind::kFailed), 0, 0, 0};
    }
    const uint32_t m_block = d * m_blocks + m_in;
    return gemm::WorkItem{static_cast<uint32_t>(gemm::WorkKind::kTile), m_block, n_block, m_block * p_.n_blocks + n_block};
  }

 private:
  // Waits for chunk `chunk` of block d. Consecutive tiles share chunks: the last one passed is
  // remembered.
  __device__ bool gate(uint32_t d, uint32_t chunk, const WaitContext& ctx) {
    if (d == passed_block_ && chunk == passed_chunk_) return true;
    const DeviceComm& c = p_.comm;
    const Grid& g = p_.layout.g;
    const uint64_t* flag = net_word(c, p_.layout.row_flag(d, chunk));
    bool ok;
    if (g.node_of(d) != g.node && g.local_of(d) == g.me) {
      // Over this GPU's own network link, from the ring predecessor.
      ok = wait_flag(flag, epoch_, ctx, net_rank_of(c, static_cast<int>(g.predecessor()), c.local_rank), FlagKind::kNetChunk,
                     p_.layout.row_flag(d, chunk));
    } else {
      // Over NVLink, from local GPU local_of(d) (its own block, or its replication of a network arrival).
      ok = wait_flag(flag, epoch_, ctx, static_cast<int>(g.local_of(d)), FlagKind::kTile, p_.layout.row_flag(d, chunk));
    }
    if (!ok) return false;
    passed_block_ = d;
    passed_chunk_ = chunk;
    // The rows were written by other agents (copy engine, NIC, peer TMA) and are read next by TMA.
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
    return true;
  }

  const AgParams& p_;
  uint64_t epoch_;
  uint32_t passed_block_ = ~0u;
  uint32_t passed_chunk_ = ~0u;
};

template <class Cfg, bool kBF16, bool kBNMajor>
__global__ void __launch_bounds__(Cfg::kThreads, 1) ag_gemm_kernel(const __grid_constant__ AgParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  static_assert(Cfg::kBlockM == static_cast<int>(kBlockM), "the multi-node layouts assume 128-row tiles");
  using Scheduler = AgScheduler<Cfg::kBlockM>;
  using Epilogue = gemm::TileEpilogue<Cfg::kBlockM>;
  using Role = gemm::ComputeRole<Cfg, kBF16, kBNMajor, Scheduler, Epilogue>;
  const DeviceComm& c = p.comm;
  const frame::LaunchFrame f = frame::LaunchFrame::enter(c, OpId::kAgGemm, nvlink_entry(c), p.signature);
  const uint64_t epoch = f.epoch;
  const WaitContext& ctx = f.ctx;
  Role::init(smem);

  const CtaRole role = p.roles.role_of(blockIdx.x);
  const uint32_t index = p.roles.index_in_role(blockIdx.x);
  auto data_role = [&](auto&& work) { return frame::run_data_role<CopyStream, Cfg::kEpiOffset>(smem, work); };
  bool compute = true;
  if (role == CtaRole::kNetSend) {
    compute = data_role([&](CopyStream& stream) { return ag_net_send(p, stream, ctx); });
  } else if (role == CtaRole::kNetRecv) {
    const uint32_t count = p.roles.count(CtaRole::kNetRecv);
    compute = data_role([&](CopyStream& stream) { return ag_net_recv(p, index, count, stream, ctx); });
  } else if (role == CtaRole::kNvlink) {
    const uint32_t count = p.roles.count(CtaRole::kNvlink);
    compute = data_role([&](CopyStream& stream) { return ag_nvlink_push(p, index, count, stream, ctx); });
  }
  f.mark(LaunchPhase::kRolesDone);
  if (compute) {
    Scheduler sched(p, epoch);
    Epilogue epi(p.epi, &p.out);
    const uint32_t own_begin = p.layout.g.own_block() * p.layout.rows_per_block;
    const gemm::GemmOperands ops{&p.a_gathered, &p.b, p.m, p.n, p.k, &p.a_local, own_begin, own_begin + p.layout.rows_per_block};
    (void)Role::run(smem, ops, sched, epi, blockIdx.x, gridDim.x, ctx);
  }
  // The proxy may still read this launch's rows (own rows, forwards) from the gathered A, which
  // the next launch overwrites (and the application may read): the launch ends once it is done.
  f.mark(LaunchPhase::kComputeDone);
  if (role == CtaRole::kNetSend && compute && threadIdx.x == 0) (void)net_wait_proxy_done(c, ctx);
  f.mark(LaunchPhase::kProxyDone);
  f.finish(p.state, c);
}

}  // namespace loom::kernels::tp::multinode
