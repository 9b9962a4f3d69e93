// Ring attention: sequence-parallel attention over the W local ranks of one node, one persistent
// kernel per call. Rank r holds the r-th chunk of the sequence (q, k, v [B, S_l, H, D]; causal: the
// zigzag layout, rank r holding sequence chunks r and 2W-1-r of S_l/2 rows each) and computes
// O_r = softmax(scale Q_r K^T) V over the keys of every rank.
//
// Roles (RingRoleTable):
//   kKvPush   CTAs [0, kv_ctas): one thread each drives a bulk-copy stream (kernels/comm/
//             bulk_copy.cuh) that pushes K and V around the ring in chunks of chunk_rows rows (all
//             KV heads): step 0 its own K/V into rank r+1's receive buffers, step s >= 1 the
//             chunks of rank r-s it received from rank r-1 (awaited, then forwarded), until every
//             rank holds every other rank's K/V; each chunk's arrival flag is set on the receiver
//             once its K and V have landed. Then the CTA joins the compute role.
//   kCompute  the attention engine (sm90_flash_fwd.cuh) with RingKeys: a query tile attends to
//             its own rank's keys first, then to rank r-1's, r-2's, ... as they arrive (the
//             producer awaits each block's chunks before loading it); the running max, sum and O
//             stay in fp32 registers across all ranks' keys (no partial O ever leaves the SM).
//             Causal: fully masked (rank, half) segments are skipped, the diagonal ones masked
//             by global positions.
//
// Buffers (the attention family's symmetric workspace; heap offsets equal on every rank; none at
// W = 1, where nothing moves and no flag is used):
//   recv_k   [W][B][S_l][Hkv][D]   W * B * S_l * Hkv * D * elem bytes: slot src holds rank src's K
//                                   (written by rank r-1; the slot of r itself is unused)
//   recv_v   the same for V
//   arrived  [W][B][chunks] uint64  W * B * ceil(S_l / chunk_rows) * 8 bytes: epoch when chunk c of
//                                   rank src's K and V (batch b) landed here (written by rank r-1)
// Entry: every CTA publishes its entry word in every peer's control-region entered[] words; a push
// stream waits (bounded) for rank r+1's word of this epoch and plan signature before its first
// write. Flags are epochs, zeroed by the host before each call (a grown workspace holds stale
// bytes); before the launch ends, CTA 0 waits for every chunk pushed into this rank (ring_drain), so
// no peer writes into the workspace after it. Forwarded chunks are loaded only once arrived, and a
// push stream never blocks on one while it still has loaded pieces to store (bulk_copy.cuh).
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/attention/config.h"
#include "kernels/attention/flags.h"
#include "kernels/attention/params.h"
#include "kernels/attention/sm90_flash_fwd.cuh"
#include "kernels/comm/bulk_copy.cuh"
#include "kernels/comm/entry.cuh"
#include "kernels/comm/net.cuh"
#include "kernels/comm/wait.cuh"
#include "kernels/frame/persistent.cuh"
#include "kernels/frame/role_table.h"
#include "runtime/device_abi.h"

namespace loom::kernels::attention {

enum class RingRole : uint32_t {
  kKvPush = 0,   // pushes and forwards K/V chunks, then computes
  kNet = 1,      // several nodes: one CTA whose thread 0 sends this rank's K/V to the other nodes and
                 // thread 32 receives theirs, then computes
  kCompute = 2,  // the attention engine on query tiles from the launch's queue
};
using RingRoleTable = frame::RoleTable<RingRole, RingRole::kCompute>;

__device__ __forceinline__ EntryWords ring_entry(const DeviceComm& c) { return {c.control.entered_offset}; }

// The source a query tile of this rank visits at step `step` (0 .. G-1): its own keys first, then,
// per local distance t = 0, 1, ..., the same-index blocks of the other nodes (t = 0: over the
// network) and the ring's (local index me - t of every node), in the order they should arrive.
__device__ __forceinline__ uint32_t ring_source_at(const JobRanks& r, uint32_t step) {
  const uint32_t n = (r.node + step % r.nodes) % r.nodes;
  const uint32_t l = (r.me + r.local - (step / r.nodes) % r.local) % r.local;
  return n * r.local + l;
}

__device__ __forceinline__ uint64_t* ring_arrived(const RingParams& p, int owner, uint32_t src, uint32_t b,
                                                  uint32_t chunk) {
  const uint64_t index = (static_cast<uint64_t>(src) * static_cast<uint64_t>(p.core.batch) + b) * p.chunks + chunk;
  return reinterpret_cast<uint64_t*>(p.comm.peer_heap_bases[owner] + p.arrived_offset + 8 * index);
}

// What one push CTA moves: positions, every kv_ctas-th one from the CTA's index, each as two
// items (K, then V with the chunk's arrival flag; one stream moves both, so the flag covers both).
//   staging (several nodes only, first): (b, chunk) of this rank's own K/V into its own receive
//     slot (the network's source: the heap holds what the proxy sends), its own flag set;
//   the NVLink ring over the L ranks of the node: (step s = 0 .. L-2, node offset o, b, chunk)
//     forwards to local rank me+1 the block of position (node m+o, local me-s): at s = 0 this
//     rank's own K/V (o = 0) or the same-index block another node sent (o > 0, awaited), at
//     s >= 1 the block local rank me-1 forwarded here (awaited).
struct RingPushList {
  const RingParams* p;
  uint32_t index;  // of this CTA among the push CTAs

  using Item = BulkForwardItem;

  __device__ uint32_t per_block() const { return static_cast<uint32_t>(p->core.batch) * p->chunks; }
  __device__ uint32_t staged() const { return JobRanks(p->comm).nodes > 1 ? per_block() : 0; }
  __device__ uint32_t positions() const {
    const JobRanks r(p->comm);
    return staged() + (r.local - 1) * r.nodes * per_block();
  }
  __device__ uint32_t count() const {
    const uint32_t n = positions();
    return index < n ? 2 * ((n - index + p->kv_ctas - 1) / p->kv_ctas) : 0;
  }
  __device__ Item item(uint32_t k) const {
    const DeviceComm& c = p->comm;
    const JobRanks r(c);
    const int me = c.local_rank;
    const int next = static_cast<int>((r.me + 1) % r.local);
    const uint32_t position = index + (k / 2) * p->kv_ctas;
    const bool is_v = (k & 1u) != 0;
    const uint32_t staging = staged();
    const bool stage = position < staging;
    const uint32_t q = stage ? position : position - staging;
    const uint32_t per_step = r.nodes * per_block();
    const uint32_t step = stage ? 0 : q / per_step;
    const uint32_t within = q % per_block();
    const uint32_t b = within / p->chunks;
    const uint32_t chunk = within % p->chunks;
    const uint32_t n = stage ? r.node : (r.node + (q % per_step) / per_block()) % r.nodes;
    const uint32_t src = n * r.local + (r.me + r.local - step) % r.local;
    const bool own = src == r.position();
    const uint32_t seq_len = static_cast<uint32_t>(p->core.seqlen_k);
    const uint32_t row = chunk * RingTunables::kChunkRows;
    const uint32_t rows = min(RingTunables::kChunkRows, seq_len - row);
    // Row (src, b, row) of a receive buffer; this rank's own K/V rows (b, row).
    const uint64_t recv_row = (static_cast<uint64_t>(src) * static_cast<uint64_t>(p->core.batch) + b) * seq_len + row;
    const uint64_t local_row = static_cast<uint64_t>(b) * seq_len + row;
    const uint64_t recv_offset = is_v ? p->recv_v_offset : p->recv_k_offset;
    const int dst_rank = stage ? me : next;
    Item it;
    it.src = own ? (is_v ? p->v_local : p->k_local) + local_row * p->row_bytes
                 : reinterpret_cast<const char*>(c.local_heap_base) + recv_offset + recv_row * p->row_bytes;
    it.dst = reinterpret_cast<char*>(c.peer_heap_bases[dst_rank]) + recv_offset + recv_row * p->row_bytes;
    it.bytes = static_cast<uint64_t>(rows) * p->row_bytes;
    it.flag = is_v ? ring_arrived(*p, dst_rank, src, b, chunk) : nullptr;
    it.rank = stage ? -1 : next;  // staging writes this rank's own heap: no entry to wait for
    it.ready = own ? nullptr : ring_arrived(*p, me, src, b, chunk);
    it.ready_rank = step == 0 ? -1 : (me - 1 + c.local_world) % c.local_world;  // -1: from the network
    it.ready_kind = kRingChunkFlag;
    it.ready_index = (src * static_cast<uint32_t>(p->core.batch) + b) * p->chunks + chunk;
    return it;
  }
};

// Several nodes, the network role's two threads (RingRole::kNet). Flags of the network window,
// from net_flag_base: word ((i * B + b) * chunks + chunk) * 2 + {0: K, 1: V} = "chunk of K / V of
// batch b from remote slot i landed" (each write carries its own flag: the K and V writes may
// complete in any order on unordered transports).
__device__ __forceinline__ uint32_t ring_net_flag(const RingParams& p, uint32_t slot, uint32_t b, uint32_t chunk,
                                                  uint32_t v) {
  return p.net_flag_base + ((slot * static_cast<uint32_t>(p.core.batch) + b) * p.chunks + chunk) * 2 + v;
}

// Thread 0: announces this rank's network entry, then sends each chunk of its own K and V, once
// staged in its own receive slot, to its same-index GPU on every other node (into the same slot
// there), then waits until the proxy has sent them all (the slot is the source). False after a
// failed (recorded) wait.
__device__ __forceinline__ bool ring_net_send(const RingParams& p, uint64_t epoch, const WaitContext& ctx) {
  const DeviceComm& c = p.comm;
  const JobRanks r(c);
  if (!announce_network_entry(c, EntryPeers::kAll, p.signature, ctx)) return false;
  const uint32_t src = r.position();
  const uint32_t seq_len = static_cast<uint32_t>(p.core.seqlen_k);
  for (uint32_t o = 1; o < r.nodes; ++o) {
    const uint32_t n = (r.node + o) % r.nodes;
    if (!wait_network_entry(c, static_cast<int>(n), p.signature, ctx)) return false;
    const int peer = net_rank_of(c, static_cast<int>(n), c.local_rank);
    const uint32_t at_peer = (r.node + r.nodes - n - 1) % r.nodes;  // the receiver's slot of this node
    for (uint32_t b = 0; b < static_cast<uint32_t>(p.core.batch); ++b) {
      for (uint32_t chunk = 0; chunk < p.chunks; ++chunk) {
        const uint32_t index = (src * static_cast<uint32_t>(p.core.batch) + b) * p.chunks + chunk;
        if (!wait_flag(ring_arrived(p, c.local_rank, src, b, chunk), epoch, ctx, -1, kRingStagedFlag, index)) return false;
        const uint32_t row = chunk * RingTunables::kChunkRows;
        const uint64_t bytes = static_cast<uint64_t>(min(RingTunables::kChunkRows, seq_len - row)) * p.row_bytes;
        const uint64_t at = ((static_cast<uint64_t>(src) * static_cast<uint64_t>(p.core.batch) + b) * seq_len + row) * p.row_bytes;
        const uint32_t lane = b * p.chunks + chunk;
        if (!net_put(c, lane, peer, p.recv_k_offset + at, p.recv_k_offset + at, bytes, ring_net_flag(p, at_peer, b, chunk, 0), ctx) ||
            !net_put(c, lane, peer, p.recv_v_offset + at, p.recv_v_offset + at, bytes, ring_net_flag(p, at_peer, b, chunk, 1), ctx)) {
          return false;
        }
      }
    }
  }
  return net_wait_proxy_done(c, ctx);
}

// Thread 32: each chunk the same-index GPUs of the other nodes send lands in their slot here;
// once both of its flags are set this thread sets the chunk's arrival flag, which the ring's
// forwarding and the compute role wait on like any other. False after a failed wait.
__device__ __forceinline__ bool ring_net_receive(const RingParams& p, uint64_t epoch, const WaitContext& ctx) {
  const DeviceComm& c = p.comm;
  const JobRanks r(c);
  for (uint32_t i = 0; i + 1 < r.nodes; ++i) {
    const uint32_t n = (r.node + 1 + i) % r.nodes;
    const uint32_t src = n * r.local + r.me;
    const int sender = net_rank_of(c, static_cast<int>(n), c.local_rank);
    for (uint32_t b = 0; b < static_cast<uint32_t>(p.core.batch); ++b) {
      for (uint32_t chunk = 0; chunk < p.chunks; ++chunk) {
        if (!net_wait(c, ring_net_flag(p, i, b, chunk, 0), sender, ctx) ||
            !net_wait(c, ring_net_flag(p, i, b, chunk, 1), sender, ctx)) {
          return false;
        }
        flag_store_release(ring_arrived(p, c.local_rank, src, b, chunk), epoch);
      }
    }
  }
  return true;
}

// The keys of a query tile of rank `me`: its own K/V first, then the other positions' in
// ring_source_at's order (one node: rank me-1's, me-2's, ...) from the receive buffers.
// Non-causal: one segment per rank (all S_l keys). Causal (zigzag): two per rank, its sequence
// chunks (src and 2W-1-src, S_l/2 rows each), a query row's position being its place in the
// whole sequence (W and the ranks counted over the whole job); at W = 1 the two chunks are
// adjacent in rows and positions, so they form one segment (no partial block between them).
template <int kBlockM, int kBlockN, bool kCausal>
struct RingKeys {
  const RingParams& p;
  uint64_t epoch;
  JobRanks ranks;
  int32_t world, me, half;  // the job's W and this rank's position; half = S_l / 2 (causal)
  // Non-causal: W segments of S_l keys, unmasked but for a partial last block: equal.
  static constexpr SegmentWalk kWalk = kCausal ? SegmentWalk::kAny : SegmentWalk::kEqual;

  __device__ RingKeys(const RingParams& params, uint64_t launch_epoch)
      : p(params),
        epoch(launch_epoch),
        ranks(params.comm),
        world(static_cast<int32_t>(ranks.world())),
        me(static_cast<int32_t>(ranks.position())),
        half(params.core.seqlen_q / 2) {}

  __device__ TileView view(uint32_t tile) const {
    TileView v;
    const uint32_t pairs = static_cast<uint32_t>(p.core.batch) * static_cast<uint32_t>(p.core.heads_q);
    v.coord = tile_at(tile, p.core.m_blocks, p.core.heads_q, pairs, kCausal, p.core.section_heads);
    v.span = SeqSpan{static_cast<int32_t>(v.coord.batch), 0, 0, p.core.seqlen_q, p.core.seqlen_k};
    v.m0 = static_cast<int32_t>(v.coord.m_block) * kBlockM;
    return v;
  }
  __device__ int segments(const TileView&) const { return kCausal && world > 1 ? 2 * world : world; }
  // Position in the whole sequence of chunk-half `h` (0, 1) of rank `rank` (zigzag).
  __device__ int32_t chunk_pos(int32_t rank, int32_t h) const { return (h == 0 ? rank : 2 * world - 1 - rank) * half; }
  __device__ int32_t q_pos(const TileView&, int32_t row) const {
    if constexpr (!kCausal) return 0;
    return row < half ? chunk_pos(me, 0) + row : chunk_pos(me, 1) + row - half;
  }
  __device__ KvSegment segment(const TileView& v, int i) const {
    const int32_t step = kCausal ? i / 2 : i;
    const int32_t src = static_cast<int32_t>(ring_source_at(ranks, static_cast<uint32_t>(step)));
    KvSegment s;
    s.k_map = step == 0 ? &p.core.k_map : &p.recv_k_map;
    s.v_map = step == 0 ? &p.core.v_map : &p.recv_v_map;
    s.batch_coord = step == 0 ? v.span.batch_coord : src * p.core.batch + v.span.batch_coord;
    s.source = step == 0 ? -1 : src;
    if constexpr (kCausal) {
      const int32_t h = i % 2;
      s.row0 = h * half;
      s.len = world > 1 ? half : 2 * half;
      s.pos0 = chunk_pos(src, h);
      // The tile's last row has the largest position (positions grow with the row).
      const int32_t last = min(v.m0 + kBlockM, v.span.len_q) - 1;
      const int32_t visible = max(0, min(s.len, q_pos(v, last) - s.pos0 + 1));
      s.blocks = (visible + kBlockN - 1) / kBlockN;
    } else {
      s.row0 = 0;
      s.len = v.span.len_k;
      s.pos0 = 0;
      s.blocks = (s.len + kBlockN - 1) / kBlockN;
    }
    return s;
  }
  // The producer thread: rows [begin, end) of segment `seg` (from another rank) have arrived.
  __device__ bool await_rows(const KvSegment& seg, int32_t begin, int32_t end, const WaitContext& wait_ctx) const {
    const uint32_t b = static_cast<uint32_t>(seg.batch_coord - seg.source * p.core.batch);
    const uint32_t first = static_cast<uint32_t>(seg.row0 + begin) / RingTunables::kChunkRows;
    const uint32_t last = static_cast<uint32_t>(seg.row0 + end - 1) / RingTunables::kChunkRows;
    const int left = (p.comm.local_rank - 1 + p.comm.local_world) % p.comm.local_world;
    for (uint32_t c = first; c <= last; ++c) {
      const uint32_t index = (static_cast<uint32_t>(seg.source) * static_cast<uint32_t>(p.core.batch) + b) * p.chunks + c;
      if (!wait_flag(ring_arrived(p, p.comm.local_rank, static_cast<uint32_t>(seg.source), b, c), epoch, wait_ctx, left,
                     kRingChunkFlag, index)) {
        return false;
      }
    }
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);  // TMA reads what the peer wrote
    return true;
  }
};

using RingPushStream = BulkCopyStream<RingTunables::kPushStages, RingTunables::kPushPieceBytes>;

// One thread, before the launch ends: every chunk pushed into this rank in this launch has
// arrived. Under causal masks some chunks are never awaited by a query tile; without this a peer's
// late writes could land after the launch, in a workspace the next call may have moved.
__device__ __forceinline__ bool ring_drain(const RingParams& p, uint64_t epoch, const WaitContext& ctx) {
  const JobRanks r(p.comm);
  const int me = p.comm.local_rank, left = (me - 1 + p.comm.local_world) % p.comm.local_world;
  for (uint32_t src = 0; src < r.world(); ++src) {
    if (src == r.position()) continue;
    for (uint32_t b = 0; b < static_cast<uint32_t>(p.core.batch); ++b) {
      for (uint32_t c = 0; c < p.chunks; ++c) {
        const uint32_t index = (src * static_cast<uint32_t>(p.core.batch) + b) * p.chunks + c;
        if (!wait_flag(ring_arrived(p, me, src, b, c), epoch, ctx, left, kRingChunkFlag, index)) {
          return false;
        }
      }
    }
  }
  return true;
}

template <class Cfg, bool kBF16, bool kCausal>
__global__ void __launch_bounds__(Cfg::kThreads, 1) sm90_ring_attention_kernel(const __grid_constant__ RingParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  using Keys = RingKeys<Cfg::kBlockM, Cfg::kBlockN, kCausal>;
  using Fwd = FlashForward<Cfg, kBF16, kCausal, Keys>;
  const DeviceComm& c = p.comm;
  const frame::LaunchFrame f = frame::LaunchFrame::enter(c, kRingAttentionOp, ring_entry(c), p.signature);
  const typename Fwd::Smem sm(smem);
  Fwd::init(sm);

  RingRoleTable roles;
  roles.set(RingRole::kKvPush, p.kv_ctas);
  roles.set(RingRole::kNet, c.net.num_nodes > 1 ? 1u : 0u);
  bool compute = true;
  if (roles.role_of(blockIdx.x) == RingRole::kNet) {
    bool ok = true;
    if (threadIdx.x == 0) ok = ring_net_send(p, f.epoch, f.ctx);
    if (threadIdx.x == 32) ok = ring_net_receive(p, f.epoch, f.ctx);
    compute = __syncthreads_and(ok ? 1 : 0) != 0;
  } else if (roles.role_of(blockIdx.x) == RingRole::kKvPush) {
    // The push stream's ring lies in the Q/K/V buffers (free until this CTA computes); the
    // barriers after them stay the compute role's.
    compute = frame::run_data_role<RingPushStream, Cfg::kBarrierOffset>(smem, [&](RingPushStream& stream) {
      const RingPushList list{&p, roles.index_in_role(blockIdx.x)};
      auto enter = [&](int rank) { return wait_entry(c, ring_entry(c), rank, f.epoch, p.signature, f.ctx); };
      return stream.push<RingTunables::kPushFlagLag>(list, f.epoch, f.ctx, enter);
    });
  }
  f.mark(LaunchPhase::kRolesDone);
  if (compute) {
    const Keys keys(p, f.epoch);
    run_attention<Cfg, kBF16, kCausal, Keys>(sm, p.core, keys, f.ctx);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) (void)ring_drain(p, f.epoch, f.ctx);
  f.finish(p.core.queue, c);
}

}  // namespace loom::kernels::attention
