// Multi-node GEMM + ReduceScatter and GEMM + AllReduce over N nodes x L GPUs: one persistent kernel
// each (the same body; gemm_ar adds an all-gather stage). Index math: layout.h
// (ReduceLayout), which also draws the buffers and flags.
//
// Every rank (n, l) computes its partial P = a @ b of all M rows; block d = (n', l') of the result
// belongs to rank (n', l'). Tiles come from the launch's queue in ReduceLayout::block_at order
// (other nodes' blocks first, this node's last; within a node's round the block this rank folds
// last) and are treated by ReduceLayout::tile_role:
//   kPartial  block (n', l'), l' != l: the epilogue rounds the fp32 tile to the input type and
//             TMA-stores it into GPU (n, l')'s fold source, local slot of this rank; then
//             partial[...] = e on it (NVLink).
//   kFold     block (n', l): before its last kStages k-blocks, the producer waits for the L - 1
//             local partials (and, for this rank's own block, the N - 1 node partials that
//             arrived over the network) and the consumers add them into the fp32 accumulators
//             in a fixed order (ReduceLayout::fold_sources: the local partials in local order,
//             then the other nodes' sums in node order; other nodes' blocks read zeros in the
//             network positions). Then:
//               another node's block: round to the input type, store into the send buffer, mark
//                                     the tile done (local flag);
//               this rank's block:    round once and store: gemm_rs into out [R, N]; gemm_ar
//                                     into every local rank's out [M, N] (NVLink), final flags
//                                     on the local peers, and the tile done for the network.
//   kSend     L = 1, another node's block: no local partials, so no fold: round into the send
//             buffer, tile done.
// Roles (RoleTable):
//   kNetSend  one CTA, the whole launch: announces the entry to every network peer, then for each
//             other node n' (round order) and each chunk of block (n', l) waits until the chunk's
//             tiles are done and pushes a network write of the send buffer rows to (n', l)'s net
//             slot for this node, flag net_partial[...] (reduce-scatter: direct, every GPU sends
//             N - 1 blocks). gemm_ar then all-gathers over the ring: its own reduced block chunk by
//             chunk as the tiles are done, then (N > 2) forwards what arrives from the predecessor,
//             flag present[d][c] on the successor. Finally it waits until the proxy has completed
//             those commands (their sources are read asynchronously).
//   kNetRecv  gemm_ar with L > 1: replicates the blocks (s, l) arriving over the network to the
//             local peers' out (present[d][c] on each). Then it computes.
//   kCompute  every other CTA.
// gemm_ar ends when this rank has seen every final and present flag of the blocks it did not
// compute itself (each CTA waits for its share), so out is complete, bit-identical everywhere.
//
// Precision: sums in fp32, the result rounded once by its owner; on the way there each other
// GPU's partial is rounded once to the input type (NVLink staging), and each other node's node
// partial once more for the network hop. The GPU tests hold the result within
// ((W + 1) u + K 2^-23) sum |a||b| (u: the input type's unit roundoff), which bounds those
// L + N - 1 roundings. Launch after launch gives the same bits: fixed order, no atomics on data.
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/net.cuh"
#include "kernels/common/sm90.cuh"
#include "kernels/gemm/compute_role.cuh"
#include "kernels/gemm/params.h"
#include "kernels/tp/flags.h"
#include "kernels/tp/peer_stores.cuh"
#include "kernels/tp/multinode/frame.cuh"
#include "kernels/tp/multinode/layout.h"

namespace loom::kernels::tp::multinode {

struct ReduceParams {
  sm90::TmaDescriptor a;         // [M, K_r]
  sm90::TmaDescriptor b;
  sm90::TmaDescriptor fold_src;  // this rank's fold source [fold_rows, N], box {64, BLOCK_M}: the fold's loads
  sm90::TmaDescriptor send;      // this rank's send buffer [(N-1) R, N], box {64, 16}
  sm90::TmaDescriptor out[TpTunables::kMaxLocalWorld];       // gemm_rs: [0] = out [R, N];
                                                             // gemm_ar: [q] = local rank q's out [M, N]; box {64, 16}
  sm90::TmaDescriptor stage_to[TpTunables::kMaxLocalWorld];  // [q] = local rank q's fold source (q != l), box {64, 16}
  DeviceComm comm;
  LaunchState* state;
  uint32_t m, n, k;
  uint32_t ramp_m;         // first raster group height in tile rows (one chunk), doubling up to group_m
  uint32_t group_m;        // raster group height after the ramp (tile rows, a multiple of ramp_m)
  uint32_t out_dtype;      // loom::DType of out and the staged partials (the input type)
  uint32_t signature;      // plan signature (entry words)
  ReduceLayout layout;
  uint64_t fold_offset;    // heap offset of the fold source buffer
  uint64_t send_offset;    // heap offset of the send buffer
  uint64_t out_offset;     // gemm_ar: heap offset of out (symmetric)
  uint64_t row_bytes;      // N * element size: a row of the partial buffers and of out
  RoleTable roles;
};
static_assert(sizeof(ReduceParams) <= 4096, "the multi-node reduce kernels' parameters must fit the classic 4 KiB limit");

// Local peers enter through the NVLink flag space (ReduceEpilogueBase).
__device__ __forceinline__ EntryWords entry_words_of(const ReduceParams& p) { return nvlink_entry(p.comm); }

// Tile-done flags (ReduceLayout::done_flag) live in the network window after the operator's other
// flags: a window word is only ever an epoch, so they need no reset between launches.
__device__ __forceinline__ uint32_t done_flag(const ReduceLayout& L, uint32_t m_block, uint32_t n_block) {
  return L.done_flag(m_block, n_block);
}

// The compute role's scheduler: the queue in block_at order, rasters within a block, the tile's
// kind from tile_role. Nothing to wait for (a and b are local).
template <int kTileM>
class ReduceScheduler {
 public:
  static_assert(kTileM == static_cast<int>(kBlockM), "the multi-node layouts assume 128-row tiles");
  __device__ explicit ReduceScheduler(const ReduceParams& p) : p_(p) {}

  __device__ gemm::WorkItem next(uint32_t /*compute_index*/, uint32_t /*num_compute*/, const WaitContext& /*ctx*/) {
    const ReduceLayout& L = p_.layout;
    const uint32_t m_blocks = L.m_blocks_per_block();
    const uint32_t per_block = L.tiles_per_block();
    const uint32_t t = atomicAdd(&p_.state->tile_queue, 1u);
    if (t >= L.g.world() * per_block) return gemm::WorkItem{static_cast<uint32_t>(gemm::WorkKind::kDone), 0, 0, 0};
    const uint32_t d = L.block_at(t / per_block);
    uint32_t m_in = 0, n_block = 0;
    raster_ramped(t % per_block, m_blocks, L.n_blocks, p_.ramp_m, p_.group_m, m_in, n_block);
    const uint32_t m_block = d * m_blocks + m_in;
    const bool fold = L.tile_role(d) == ReduceLayout::TileRole::kFold;
    return gemm::WorkItem{static_cast<uint32_t>(fold ? gemm::WorkKind::kTileFold : gemm::WorkKind::kTile), m_block, n_block,
                          m_block * L.n_blocks + n_block};
  }

 private:
  const ReduceParams& p_;
};

// The compute role's Fold policy (ComputeRole explains the interface).
template <int kTileM>
class ReduceFold {
 public:
  static constexpr bool kEnabled = true;
  __device__ ReduceFold(const ReduceParams& p, uint64_t epoch) : p_(p), epoch_(epoch) {}

  __device__ uint32_t world() const { return p_.layout.fold_sources(); }
  __device__ uint32_t self() const { return p_.layout.g.me; }
  __device__ const sm90::TmaDescriptor* map() const { return &p_.fold_src; }

  __device__ int32_t source_row(const gemm::WorkItem& tile, uint32_t source) const {
    const ReduceLayout& L = p_.layout;
    const uint32_t d = tile.m_block / L.m_blocks_per_block();
    const uint32_t row_in_block = (tile.m_block - d * L.m_blocks_per_block()) * kTileM;
    return static_cast<int32_t>(L.fold_source_row(d, row_in_block, source));
  }

  // Producer thread: every source of the tile is in place (bounded waits).
  __device__ bool wait_sources(const gemm::WorkItem& tile, const WaitContext& ctx) const {
    const ReduceLayout& L = p_.layout;
    const Grid& g = L.g;
    const DeviceComm& c = p_.comm;
    const uint32_t d = tile.m_block / L.m_blocks_per_block();
    const uint32_t m_in = tile.m_block - d * L.m_blocks_per_block();
    const uint32_t t = m_in * L.n_blocks + tile.n_block;
    for (uint32_t v = 0; v < g.local; ++v) {
      if (v == g.me) continue;
      const uint32_t flag = L.partial_flag(Grid::slot(v, g.me, g.local), g.node_of(d), t);
      if (!wait_flag(net_word(c, flag), epoch_, ctx, static_cast<int>(v), kPartialFlag, flag)) return false;
    }
    if (g.node_of(d) == g.node) {
      const uint32_t chunk = (m_in * kTileM) / L.rows_per_chunk;
      for (uint32_t v = g.local; v < L.fold_sources(); ++v) {
        const uint32_t src = L.fold_source_node(v);
        const uint32_t flag = L.net_partial_flag(Grid::slot(src, g.node, g.nodes), chunk);
        if (!wait_flag(net_word(c, flag), epoch_, ctx, net_rank_of(c, static_cast<int>(src), c.local_rank), FlagKind::kNetChunk,
                       flag)) {
          return false;
        }
      }
    }
    // Peers, the copy engine or the NIC wrote the sources; TMA reads them next.
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
    return true;
  }

 private:
  const ReduceParams& p_;
  uint64_t epoch_;
};

// The compute role's epilogue policy (TileEpilogue explains the interface): routes each staged
// box by the tile's role and signals per tile.
template <int kTileM, bool kAllReduce>
class ReduceEpilogue : public ReduceEpilogueBase<ReduceParams> {
 public:
  using ReduceEpilogueBase::ReduceEpilogueBase;

  __device__ void prefetch() const {
    const Grid& g = p_.layout.g;
    sm90::prefetch_tensormap(&p_.send);
    if constexpr (kAllReduce) {
      for (uint32_t q = 0; q < g.local; ++q) sm90::prefetch_tensormap(&p_.out[q]);
    } else {
      sm90::prefetch_tensormap(&p_.out[0]);
    }
    for (uint32_t q = 0; q < g.local; ++q) {
      if (q != g.me) sm90::prefetch_tensormap(&p_.stage_to[q]);
    }
  }

  // Lane 0 of a consumer warp: the 16-row box whose top-left element is (row, col).
  __device__ void issue(const void* box, const gemm::WorkItem& /*tile*/, uint32_t row, uint32_t col) const {
    const ReduceLayout& L = p_.layout;
    const Grid& g = L.g;
    const uint32_t d = row / L.rows_per_block;
    const uint32_t row_in_block = row - d * L.rows_per_block;
    const uint32_t owner_local = g.local_of(d);
    if (owner_local != g.me) {
      if (!entered(owner_local)) return;  // failure recorded; the launch is aborting
      const uint32_t j = Grid::slot(g.me, owner_local, g.local);
      tma_store_2d(&p_.stage_to[owner_local], col, L.local_slot_row(j, g.node_of(d)) + row_in_block, box);
    } else if (g.node_of(d) != g.node) {
      tma_store_2d(&p_.send, col, L.send_row(g.node_of(d)) + row_in_block, box);
    } else if constexpr (kAllReduce) {
      for (uint32_t i = 0; i < g.local; ++i) {
        const uint32_t q = (g.me + i) % g.local;  // ours first, then the local peers
        if (q != g.me && !entered(q)) continue;
        tma_store_2d(&p_.out[q], col, row, box);
      }
    } else {
      tma_store_2d(&p_.out[0], col, row_in_block, box);
    }
  }

  // One thread (the compute role's signaler), once every box of `tile` has landed.
  __device__ void signal(const gemm::WorkItem& tile, uint32_t /*m_blocks*/, uint32_t /*n_blocks*/) const {
    // A failed entry wait skipped a box and raised the device abort: signal nothing then.
    if (ctx_.device_aborted()) return;
    const ReduceLayout& L = p_.layout;
    const Grid& g = L.g;
    const DeviceComm& c = p_.comm;
    const uint32_t d = tile.m_block / L.m_blocks_per_block();
    const uint32_t t = (tile.m_block - d * L.m_blocks_per_block()) * L.n_blocks + tile.n_block;
    const uint32_t owner_local = g.local_of(d);
    __threadfence_system();
    if (owner_local != g.me) {
      const uint32_t j = Grid::slot(g.me, owner_local, g.local);
      flag_store_release(net_word_at(c, static_cast<int>(owner_local), L.partial_flag(j, g.node_of(d), t)), epoch_);
    } else if (g.node_of(d) != g.node) {
      flag_store_release(net_word(c, done_flag(L, tile.m_block, tile.n_block)), epoch_);
    } else if constexpr (kAllReduce) {
      for (uint32_t q = 0; q < g.local; ++q) {
        if (q != g.me) flag_store_release(net_word_at(c, static_cast<int>(q), L.final_flag(g.me, t)), epoch_);
      }
      flag_store_release(net_word(c, done_flag(L, tile.m_block, tile.n_block)), epoch_);
    }
  }
};

// Waits (one thread) until the tiles of chunk `chunk` of block d are done on this rank.
__device__ __forceinline__ bool wait_chunk_tiles(const ReduceParams& p, uint32_t d, uint32_t chunk, const WaitContext& ctx) {
  const ReduceLayout& L = p.layout;
  const uint32_t first = d * L.m_blocks_per_block() + chunk * L.tile_rows_per_chunk();
  for (uint32_t m = first; m < first + L.tile_rows_per_chunk(); ++m) {
    for (uint32_t nb = 0; nb < L.n_blocks; ++nb) {
      const uint32_t flag = done_flag(L, m, nb);
      if (!wait_flag(net_word(p.comm, flag), ctx.epoch, ctx, p.comm.local_rank, FlagKind::kTile, flag)) return false;
    }
  }
  return true;
}

// kNetSend (thread 0), for the whole launch.
template <bool kAllReduce>
__device__ bool reduce_net_send(const ReduceParams& p, const WaitContext& ctx) {
  const DeviceComm& c = p.comm;
  const ReduceLayout& L = p.layout;
  const Grid& g = L.g;
  if (!announce_network_entry(c, EntryPeers::kAll, p.signature, ctx)) return false;
  const uint32_t cpb = L.chunks_per_block();
  const uint64_t bytes = static_cast<uint64_t>(L.rows_per_chunk) * p.row_bytes;
  // Reduce-scatter: this node's partial of block (n', l), straight to its owner.
  uint32_t entered_node = ~0u;
  for (uint32_t k = 0; k < L.rs_sends(); ++k) {
    const uint32_t dst_node = L.rs_send_node(k);
    const uint32_t chunk = k % cpb;
    if (!wait_chunk_tiles(p, g.block(dst_node, g.me), chunk, ctx)) return false;
    if (dst_node != entered_node) {
      if (!wait_network_entry(c, static_cast<int>(dst_node), p.signature, ctx)) return false;
      entered_node = dst_node;
    }
    const uint32_t k_dst = Grid::slot(g.node, dst_node, g.nodes);  // this node's slot at the owner
    const uint64_t src = p.send_offset + (static_cast<uint64_t>(L.send_row(dst_node)) + chunk * L.rows_per_chunk) * p.row_bytes;
    const uint64_t dst = p.fold_offset + (static_cast<uint64_t>(L.net_slot_row(k_dst)) + chunk * L.rows_per_chunk) * p.row_bytes;
    if (!net_put(c, k, net_rank_of(c, static_cast<int>(dst_node), c.local_rank), src, dst, bytes, L.net_partial_flag(k_dst, chunk),
                 ctx)) {
      return false;
    }
  }
  if constexpr (kAllReduce) {
    // All-gather over the ring: our reduced block, then (N > 2) forwards from the predecessor.
    const int successor = net_rank_of(c, static_cast<int>(g.successor()), c.local_rank);
    const int predecessor = net_rank_of(c, static_cast<int>(g.predecessor()), c.local_rank);
    if (L.ag_sends() > 0 && !wait_network_entry(c, static_cast<int>(g.successor()), p.signature, ctx)) return false;
    for (uint32_t k = 0; k < L.ag_sends(); ++k) {
      const uint32_t d = L.ag_send_block(k);
      const uint32_t chunk = k % cpb;
      if (k < cpb) {
        if (!wait_chunk_tiles(p, d, chunk, ctx)) return false;
      } else if (!net_wait(c, L.present_flag(d, chunk), predecessor, ctx)) {
        return false;
      }
      const uint64_t offset =
          p.out_offset + (static_cast<uint64_t>(d) * L.rows_per_block + static_cast<uint64_t>(chunk) * L.rows_per_chunk) * p.row_bytes;
      if (!net_put(c, L.rs_sends() + k, successor, offset, offset, bytes, L.present_flag(d, chunk), ctx)) return false;
    }
  }
  // The send buffer (and gemm_ar's out) is read by the proxy after the commands are pushed; the
  // launch ends only once that is done, so the next launch (or the application) may overwrite it.
  return net_wait_proxy_done(c, ctx);
}

// kNetRecv (gemm_ar, L > 1; thread 0): network arrivals of blocks (s, l) to the local peers' out.
__device__ __forceinline__ bool reduce_net_recv(const ReduceParams& p, uint32_t index, uint32_t count,
                                                CopyStream& stream, const WaitContext& ctx) {
  const DeviceComm& c = p.comm;
  const ReduceLayout& L = p.layout;
  const int predecessor = net_rank_of(c, static_cast<int>(L.g.predecessor()), c.local_rank);
  const uint32_t cpb = L.chunks_per_block();
  const uint64_t bytes = static_cast<uint64_t>(L.rows_per_chunk) * p.row_bytes;
  uint32_t entered = 0;
  for (uint32_t k = index; k < L.replications(); k += count) {
    const uint32_t d = L.replication_block(k);
    const uint32_t chunk = k % cpb;
    const uint32_t flag = L.present_flag(d, chunk);
    if (!net_wait(c, flag, predecessor, ctx)) return false;
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
    const uint64_t offset =
        p.out_offset + (static_cast<uint64_t>(d) * L.rows_per_block + static_cast<uint64_t>(chunk) * L.rows_per_chunk) * p.row_bytes;
    if (!replicate_to_local_peers(c, p.signature, offset, reinterpret_cast<const char*>(c.local_heap_base + offset), bytes,
                                     flag, entered, stream, ctx)) {
      return false;
    }
  }
  return true;
}

// gemm_ar's end (thread 0 of every CTA): this CTA's share of the flags of blocks computed
// elsewhere (ReduceLayout::arrivals).
__device__ __forceinline__ bool reduce_wait_arrivals(const ReduceParams& p, const WaitContext& ctx) {
  const DeviceComm& c = p.comm;
  const ReduceLayout& L = p.layout;
  const Grid& g = L.g;
  const uint32_t tpb = L.tiles_per_block();
  const uint32_t cpb = L.chunks_per_block();
  const uint32_t local_items = (g.local - 1) * tpb;
  const int predecessor = net_rank_of(c, static_cast<int>(g.predecessor()), c.local_rank);
  for (uint32_t k = blockIdx.x; k < L.arrivals(); k += gridDim.x) {
    uint32_t flag;
    int waited_on;
    FlagKind kind;
    if (k < local_items) {
      const uint32_t q = k / tpb;
      const uint32_t owner = q < g.me ? q : q + 1;
      flag = L.final_flag(owner, k % tpb);
      waited_on = static_cast<int>(owner);
      kind = kFinalFlag;
    } else {
      const uint32_t r = k - local_items;
      const uint32_t i = r / (g.local * cpb);
      const uint32_t node = i < g.node ? i : i + 1;
      const uint32_t rest = r - i * g.local * cpb;
      const uint32_t owner_local = rest / cpb;
      flag = L.present_flag(g.block(node, owner_local), rest % cpb);
      if (owner_local == g.me) {
        waited_on = predecessor;
        kind = FlagKind::kNetChunk;
      } else {
        waited_on = static_cast<int>(owner_local);
        kind = kFinalFlag;
      }
    }
    if (!wait_flag(net_word(c, flag), ctx.epoch, ctx, waited_on, kind, flag)) return false;
  }
  return true;
}

template <class Cfg, bool kBF16, bool kBNMajor, bool kAllReduce>
__device__ __forceinline__ void reduce_body(const ReduceParams& p, uint8_t* smem) {
  static_assert(Cfg::kBlockM == static_cast<int>(kBlockM), "the multi-node layouts assume 128-row tiles");
  using Scheduler = ReduceScheduler<Cfg::kBlockM>;
  using Epilogue = ReduceEpilogue<Cfg::kBlockM, kAllReduce>;
  using Fold = ReduceFold<Cfg::kBlockM>;
  using Role = gemm::ComputeRole<Cfg, kBF16, kBNMajor, Scheduler, Epilogue, Cfg::kSetMaxNReg, Fold>;
  const DeviceComm& c = p.comm;
  const frame::LaunchFrame f =
      frame::LaunchFrame::enter(c, kAllReduce ? OpId::kGemmAr : OpId::kGemmRs, nvlink_entry(c), p.signature);
  const uint64_t epoch = f.epoch;
  const WaitContext& ctx = f.ctx;
  Role::init(smem);

  const CtaRole role = p.roles.role_of(blockIdx.x);
  auto data_role = [&](auto&& work) { return frame::run_data_role<CopyStream, Cfg::kEpiOffset>(smem, work); };
  bool ok = true;
  bool compute = true;
  if (role == CtaRole::kNetSend) {
    // Sends for the whole launch (no stream: the proxy reads the send buffer and out directly).
    ok = data_role([&](CopyStream&) { return reduce_net_send<kAllReduce>(p, ctx); });
    compute = false;
  } else if (role == CtaRole::kNetRecv) {
    const uint32_t index = p.roles.index_in_role(blockIdx.x);
    const uint32_t count = p.roles.count(CtaRole::kNetRecv);
    ok = data_role([&](CopyStream& stream) { return reduce_net_recv(p, index, count, stream, ctx); });
    compute = ok;
  }
  f.mark(LaunchPhase::kRolesDone);
  if (compute) {
    Scheduler sched(p);
    Epilogue epi(p, epoch, ctx);
    const Fold fold(p, epoch);
    const gemm::GemmOperands ops{&p.a, &p.b, p.m, p.n, p.k};
    const gemm::WorkItem exit = Role::run(smem, ops, sched, epi, blockIdx.x, gridDim.x, ctx, fold);
    ok = exit.kind == static_cast<uint32_t>(gemm::WorkKind::kDone);
  }
  f.mark(LaunchPhase::kComputeDone);
  if constexpr (kAllReduce) {
    if (ok && threadIdx.x == 0) (void)reduce_wait_arrivals(p, ctx);
  }
  f.finish(p.state, c);
}

template <class Cfg, bool kBF16, bool kBNMajor>
__global__ void __launch_bounds__(Cfg::kThreads, 1) gemm_rs_kernel(const __grid_constant__ ReduceParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  reduce_body<Cfg, kBF16, kBNMajor, /*kAllReduce=*/false>(p, smem);
}

template <class Cfg, bool kBF16, bool kBNMajor>
__global__ void __launch_bounds__(Cfg::kThreads, 1) gemm_ar_kernel(const __grid_constant__ ReduceParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  reduce_body<Cfg, kBF16, kBNMajor, /*kAllReduce=*/true>(p, smem);
}

}  // namespace loom::kernels::tp::multinode
