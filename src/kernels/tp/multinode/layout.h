// Index math of the multi-node operators (ag_gemm, gemm_rs, gemm_ar over N nodes x L GPUs): the
// grid of ranks, the orders in which blocks are computed and sent, buffer rows and flag indices.
// Plain C++ with LOOM_HOST_DEVICE functions: the kernels, the host launchers and the CPU tests
// (tests/cpu/multinode_layout_test.cc) compute every index from here, so what a sender writes and
// what its receiver waits for cannot drift apart.
//
// Ranks. Rank (n, l) is the GPU with local index l on node n (Topology::rank_of). The M rows of
// the operators are cut into W = N * L row blocks of R = M / W rows; block d = n * L + l belongs
// to rank (n, l) (with the usual launchers, RANK = n * L + l, so block d is rank d's). Data that
// crosses nodes only ever travels between GPUs of the same local index l (the hierarchical rule:
// NVLink first reduces or replicates so each GPU moves only its 1/L share over the network).
// A block is moved in chunks of rows_per_chunk rows (whole 128-row tile rows, about 1 MiB), one
// flag per chunk.
//
// Network patterns. ag_gemm and gemm_ar's all-gather stage use a ring over the nodes: node n sends
// to its successor (n + 1) mod N, its own block first, then forwards what arrives from its
// predecessor (blocks of nodes n - 1, n - 2, ..., n - N + 2), so every GPU sends N - 1 blocks and
// never fans out (N = 2 is the direct exchange). gemm_rs's reduce-scatter stage is direct: the
// node partial of block (n', l) goes straight from (n, l) to (n', l); every GPU still sends
// exactly N - 1 blocks (the volume of a reduce-scatter), and the owner folds the N - 1 arriving
// node partials in a fixed node order.
#pragma once

#include <cstdint>

#include "kernels/frame/role_table.h"
#include "runtime/device_abi.h"

namespace loom::kernels::tp::multinode {

// Every multi-node configuration has 128-row tiles (BLOCK_M); rows of a rank never share a tile.
inline constexpr uint32_t kBlockM = 128;
// Chunks (one network command and one flag each) aim at this many bytes: large enough to amortise
// a command, a flag and the proxy's per-operation cost, small enough that the first dependent
// tiles start early.
inline constexpr uint64_t kTargetChunkBytes = uint64_t{1} << 20;

// The most whole tile rows (a multiple of kBlockM dividing rows_per_block) whose chunk of
// `row_bytes`-byte rows stays within `target` bytes; at least one tile row. rows_per_block must
// be a positive multiple of kBlockM.
LOOM_HOST_DEVICE uint32_t rows_per_chunk_for(uint32_t rows_per_block, uint64_t row_bytes, uint64_t target) {
  const uint32_t tile_rows = rows_per_block / kBlockM;
  const uint64_t tile_row_bytes = static_cast<uint64_t>(kBlockM) * row_bytes;
  const uint64_t most = tile_row_bytes == 0 ? tile_rows : target / tile_row_bytes;
  uint32_t best = 1;
  for (uint32_t c = 1; c <= tile_rows && c <= most; ++c) {
    if (tile_rows % c == 0) best = c;
  }
  return best * kBlockM;
}

// Roles a CTA takes, from the role table (never from bare index arithmetic).
enum class CtaRole : uint32_t {
  kNetSend = 0,  // pushes network commands (own data, forwards, reduced partials); entry announcer
  kNetRecv = 1,  // waits for network arrivals and replicates them to the local peers over NVLink
  kNvlink = 2,   // pushes this rank's own data to the local peers over NVLink
  kCompute = 3,  // the GEMM engine's compute role on tiles from the launch's queue
};

// CTAs [0, net_send) send, then [.., + net_recv) receive, then [.., + nvlink) NVLink, the rest
// compute (kernels/frame/role_table.h). Roles other than kNetSend join the compute role when
// their items are done (ag_gemm); the reduce kernels' kNetSend works for the whole launch.
using RoleTable = frame::RoleTable<CtaRole, CtaRole::kCompute>;

// N nodes x L GPUs, and this rank (node, me).
struct Grid {
  uint32_t nodes = 1;  // N
  uint32_t local = 1;  // L
  uint32_t node = 0;   // n
  uint32_t me = 0;     // l

  LOOM_HOST_DEVICE uint32_t world() const { return nodes * local; }
  LOOM_HOST_DEVICE uint32_t block(uint32_t n, uint32_t l) const { return n * local + l; }
  LOOM_HOST_DEVICE uint32_t own_block() const { return block(node, me); }
  LOOM_HOST_DEVICE uint32_t node_of(uint32_t d) const { return d / local; }
  LOOM_HOST_DEVICE uint32_t local_of(uint32_t d) const { return d % local; }
  LOOM_HOST_DEVICE uint32_t successor() const { return (node + 1) % nodes; }
  LOOM_HOST_DEVICE uint32_t predecessor() const { return (node + nodes - 1) % nodes; }
  // The node h hops behind on the ring: (n - h) mod N (h = 0: this node).
  LOOM_HOST_DEVICE uint32_t node_behind(uint32_t h) const { return (node + nodes - h % nodes) % nodes; }
  // Slot of `src`'s data among the N - 1 (or L - 1) others, seen from `owner`: (src - owner - 1)
  // mod count. Sender and receiver compute the same value for a pair.
  LOOM_HOST_DEVICE static uint32_t slot(uint32_t src, uint32_t owner, uint32_t count) {
    return (src + count - owner - 1) % count;
  }
};

// ---- ag_gemm -----------------------------------------------------------------------------------
//
// Buffers: the gathered A [M, K] (symmetric: the user's gathered_a or the multi-node workspace);
// block d's rows [d R, (d + 1) R) are written by its owner (own rows, when not already in place),
// by the network (blocks (s, l), s != n) and by NVLink (blocks (n, l') pushed by their owners,
// blocks (s, l') replicated by local GPU l').
// Flags (network window, from launch_base): row[d][c] = base + d * cpb + c: "chunk c of block d is
// in my gathered A"; never set for this rank's own block (its tiles read the shard directly).
struct AgLayout {
  Grid g;
  uint32_t rows_per_block = 0;  // R
  uint32_t rows_per_chunk = 0;  // divides R, a multiple of kBlockM
  uint32_t flag_base = 0;       // NetWindowLayout::launch_base()

  LOOM_HOST_DEVICE uint32_t chunks_per_block() const { return rows_per_block / rows_per_chunk; }
  LOOM_HOST_DEVICE uint32_t flags() const { return g.world() * chunks_per_block(); }
  LOOM_HOST_DEVICE uint32_t row_flag(uint32_t block, uint32_t chunk) const {
    return flag_base + block * chunks_per_block() + chunk;
  }
  LOOM_HOST_DEVICE uint32_t block_of_row(uint32_t row) const { return row / rows_per_block; }
  LOOM_HOST_DEVICE uint32_t chunk_of_row(uint32_t row) const { return (row % rows_per_block) / rows_per_chunk; }

  // Compute order, position i in [0, W): this rank's block first (it waits for nothing), the
  // node's other GPUs' blocks (NVLink, fast), then the other nodes' blocks in the order the ring
  // delivers them (hop 1 first), starting each node with the block that arrives over our own
  // network link.
  LOOM_HOST_DEVICE uint32_t block_at(uint32_t i) const {
    if (i < g.local) return g.block(g.node, (g.me + i) % g.local);
    const uint32_t j = i - g.local;
    return g.block(g.node_behind(1 + j / g.local), (g.me + j % g.local) % g.local);
  }

  // The network-send role's items, k in [0, sends()): block send_block(k), chunk k % cpb, to the
  // successor. Items of hop h = k / cpb: h = 0 is this rank's own block (sent as soon as its rows
  // are in the gathered A), h >= 1 forwards block (n - h, l) once it has arrived.
  LOOM_HOST_DEVICE uint32_t sends() const { return (g.nodes - 1) * chunks_per_block(); }
  LOOM_HOST_DEVICE uint32_t send_hop(uint32_t k) const { return k / chunks_per_block(); }
  LOOM_HOST_DEVICE uint32_t send_block(uint32_t k) const { return g.block(g.node_behind(send_hop(k)), g.me); }

  // The network-receive role's items (L > 1), k in [0, replications()): block (n - h, l) with
  // h = 1 + k / cpb, chunk k % cpb, copied to every local peer once it has arrived.
  LOOM_HOST_DEVICE uint32_t replications() const { return g.local > 1 ? (g.nodes - 1) * chunks_per_block() : 0; }
  LOOM_HOST_DEVICE uint32_t replication_block(uint32_t k) const {
    return g.block(g.node_behind(1 + k / chunks_per_block()), g.me);
  }
};

// ---- gemm_rs and gemm_ar -----------------------------------------------------------------------
//
// Every rank computes its partial P = a @ b of all M rows. Block (n', l') of P is reduced in two
// stages: over NVLink to GPU (n, l') of every node (the L local partials folded into a node
// partial), then over the network to the owner (n', l'), which folds the N node partials.
//
// Workspace of rank (n, l) (symmetric, equal offsets; elements of the input type, rows of N cols):
//   fold source  one buffer, one TMA map (what the compute role's fold loads from):
//     local slot (j, n')  rows [(j N + n') R, +R)       j = slot(src, l, L): local GPU src's partial
//                                                       of block (n', l)            (L > 1)
//     net slot k          rows [((L - 1) N + k) R, +R)  k = slot(src node, n, N): node src's node
//                                                       partial of block (n, l)
//     zero rows           rows [((L - 1) N + N - 1) R, +kBlockM), never written (L > 1: the network
//                         sources of folds of other nodes' blocks, see fold_source_row)
//   send buffer  rows [k' R, +R), k' = slot(n', n, N): this node's partial of block (n', l),
//                written by the fold epilogue, read by the proxy
// Flags (network window, from launch_base; tpb = tiles per block, cpb = chunks per block):
//   partial[j][n'][t]   base + (j N + n') tpb + t                  by local GPU src over NVLink
//   net_partial[k][c]   base + P0 + k cpb + c,  P0 = (L-1) N tpb    by the proxy (node partials)
//   final[l'][t]        base + P1 + l' tpb + t, P1 = P0 + (N-1) cpb gemm_ar: local owner l' stored
//                                                                 its reduced tile t in my out
//   present[d][c]       base + P2 + d cpb + c,  P2 = P1 + L tpb    gemm_ar: chunk c of block d
//                                                                 (another node's) is in my out
//   done[m][nb]         base + P3 + m nb_count + nb, P3 = P2 + W cpb (gemm_ar) or P1 (gemm_rs):
//                                                                 local words, tile finished
struct ReduceLayout {
  Grid g;
  uint32_t rows_per_block = 0;  // R
  uint32_t n_blocks = 0;        // tile columns
  uint32_t rows_per_chunk = 0;  // divides R, a multiple of kBlockM
  uint32_t flag_base = 0;
  uint32_t all_reduce = 0;      // 1: gemm_ar (the all-gather stage's flags exist)

  LOOM_HOST_DEVICE uint32_t m_blocks_per_block() const { return rows_per_block / kBlockM; }
  LOOM_HOST_DEVICE uint32_t tiles_per_block() const { return m_blocks_per_block() * n_blocks; }
  LOOM_HOST_DEVICE uint32_t chunks_per_block() const { return rows_per_block / rows_per_chunk; }
  LOOM_HOST_DEVICE uint32_t tile_rows_per_chunk() const { return rows_per_chunk / kBlockM; }

  // Fold source rows.
  LOOM_HOST_DEVICE uint32_t local_slot_row(uint32_t j, uint32_t node) const { return (j * g.nodes + node) * rows_per_block; }
  LOOM_HOST_DEVICE uint32_t net_slot_row(uint32_t k) const { return ((g.local - 1) * g.nodes + k) * rows_per_block; }
  LOOM_HOST_DEVICE uint32_t zero_row() const { return ((g.local - 1) * g.nodes + g.nodes - 1) * rows_per_block; }
  LOOM_HOST_DEVICE uint32_t fold_rows() const { return zero_row() + (g.local > 1 ? kBlockM : 0); }
  // Send buffer rows of this node's partial of block (n', l).
  LOOM_HOST_DEVICE uint32_t send_row(uint32_t dst_node) const { return Grid::slot(dst_node, g.node, g.nodes) * rows_per_block; }
  LOOM_HOST_DEVICE uint32_t send_rows() const { return (g.nodes - 1) * rows_per_block; }

  // Flags.
  LOOM_HOST_DEVICE uint32_t partial_flag(uint32_t j, uint32_t node, uint32_t t) const {
    return flag_base + (j * g.nodes + node) * tiles_per_block() + t;
  }
  LOOM_HOST_DEVICE uint32_t p0() const { return (g.local - 1) * g.nodes * tiles_per_block(); }
  LOOM_HOST_DEVICE uint32_t net_partial_flag(uint32_t k, uint32_t c) const { return flag_base + p0() + k * chunks_per_block() + c; }
  LOOM_HOST_DEVICE uint32_t p1() const { return p0() + (g.nodes - 1) * chunks_per_block(); }
  LOOM_HOST_DEVICE uint32_t final_flag(uint32_t owner_local, uint32_t t) const { return flag_base + p1() + owner_local * tiles_per_block() + t; }
  LOOM_HOST_DEVICE uint32_t p2() const { return p1() + g.local * tiles_per_block(); }
  LOOM_HOST_DEVICE uint32_t present_flag(uint32_t block, uint32_t c) const { return flag_base + p2() + block * chunks_per_block() + c; }
  LOOM_HOST_DEVICE uint32_t p3() const { return all_reduce != 0 ? p2() + g.world() * chunks_per_block() : p1(); }
  // done[m_block][n_block]: local words, "this rank finished tile (m_block, n_block)" (epilogue ->
  // network-send role); only this rank writes and reads them.
  LOOM_HOST_DEVICE uint32_t done_flag(uint32_t m_block, uint32_t n_block) const {
    return flag_base + p3() + m_block * n_blocks + n_block;
  }
  // Words this launch uses from flag_base on.
  LOOM_HOST_DEVICE uint32_t flags() const { return p3() + g.world() * tiles_per_block(); }

  // Compute order, position i in [0, W): rounds of L blocks; round r < N - 1 covers node
  // n + r + 1, the last round this node; within a round the node's GPUs l + 1, ..., l (so the
  // block this rank folds comes last in its round, after the partials it needs were computed
  // everywhere). Other nodes' blocks come first: their node partials travel the network.
  LOOM_HOST_DEVICE uint32_t block_at(uint32_t i) const {
    const uint32_t round = i / g.local;
    const uint32_t hop = round + 1 < g.nodes ? round + 1 : 0;
    return g.block((g.node + hop) % g.nodes, (g.me + 1 + i % g.local) % g.local);
  }
  // How this rank treats a tile of block d.
  enum class TileRole : uint32_t {
    kPartial = 0,  // another local GPU folds this block: stage the partial there (NVLink)
    kFold = 1,     // fold the staged partials (and, own block, the node partials), then store
    kSend = 2,     // L = 1, another node's block: no local partials; round into the send buffer
  };
  LOOM_HOST_DEVICE TileRole tile_role(uint32_t d) const {
    if (g.local_of(d) != g.me) return TileRole::kPartial;
    return (g.local > 1 || g.node_of(d) == g.node) ? TileRole::kFold : TileRole::kSend;
  }

  // Fold sources, in the order they are added: v < L the local GPUs (v = me is this rank's own
  // fp32 accumulator, which the others are added to), then v = L + i the node partials of the
  // other nodes in increasing node order (i -> node i, or i + 1 from this node on). acc = (((a +
  // p_v1) + p_v2) + ...) + q_0 + ..., a this rank's accumulator (TileFold::fold_partials (gemm/fold.cuh)):
  // fixed for each block, so the result is the same on every launch.
  LOOM_HOST_DEVICE uint32_t fold_sources() const { return g.local + g.nodes - 1; }
  LOOM_HOST_DEVICE uint32_t fold_source_node(uint32_t v) const {
    const uint32_t i = v - g.local;
    return i < g.node ? i : i + 1;
  }
  // Row of the fold source buffer where source v's rows for the tile starting at row_in_block of
  // block d are. Network sources of another node's block (L > 1 only) read zeros.
  LOOM_HOST_DEVICE uint32_t fold_source_row(uint32_t d, uint32_t row_in_block, uint32_t v) const {
    if (v < g.local) return local_slot_row(Grid::slot(v, g.me, g.local), g.node_of(d)) + row_in_block;
    if (g.node_of(d) != g.node) return zero_row();
    return net_slot_row(Grid::slot(fold_source_node(v), g.node, g.nodes)) + row_in_block;
  }

  // The network-send role's items. Reduce-scatter, k in [0, rs_sends()): round r = k / cpb sends
  // this node's partial of block (n + r + 1, l), chunk k % cpb, straight to its owner.
  LOOM_HOST_DEVICE uint32_t rs_sends() const { return (g.nodes - 1) * chunks_per_block(); }
  LOOM_HOST_DEVICE uint32_t rs_send_node(uint32_t k) const { return (g.node + 1 + k / chunks_per_block()) % g.nodes; }
  // All-gather (gemm_ar), k in [0, ag_sends()): hop h = k / cpb; h = 0 sends this rank's reduced
  // block, h >= 1 forwards block (n - h, l) from the predecessor; all to the successor.
  LOOM_HOST_DEVICE uint32_t ag_sends() const { return all_reduce != 0 ? (g.nodes - 1) * chunks_per_block() : 0; }
  LOOM_HOST_DEVICE uint32_t ag_send_block(uint32_t k) const { return g.block(g.node_behind(k / chunks_per_block()), g.me); }
  // gemm_ar replication (L > 1): block (n - h, l), h = 1 + k / cpb, to every local peer.
  LOOM_HOST_DEVICE uint32_t replications() const {
    return all_reduce != 0 && g.local > 1 ? (g.nodes - 1) * chunks_per_block() : 0;
  }
  LOOM_HOST_DEVICE uint32_t replication_block(uint32_t k) const {
    return g.block(g.node_behind(1 + k / chunks_per_block()), g.me);
  }
  // gemm_ar's end: the flags a rank waits for before its out is complete, k in [0, arrivals()):
  // first the tiles of the node's other blocks (final[l'][t], l' != l), then every chunk of the
  // other nodes' blocks (present[d][c]).
  LOOM_HOST_DEVICE uint32_t arrivals() const {
    return all_reduce != 0 ? (g.local - 1) * tiles_per_block() + (g.nodes - 1) * g.local * chunks_per_block() : 0;
  }
};

// Raster position `within` of a block of `m_blocks` tile rows x `n_blocks` tile columns, in
// groups that start `first` tile rows high and double up to `group` (both dividing m_blocks's
// granule; the last group takes what is left), columns fastest within a group's rows. Blocks whose
// rows cross the network chunk by chunk use it: the first chunks complete (and the link starts)
// after a fraction of a wave, and the later, taller groups keep the GEMM's L2 reuse.
LOOM_HOST_DEVICE void raster_ramped(uint32_t within, uint32_t m_blocks, uint32_t n_blocks, uint32_t first,
                                   uint32_t group, uint32_t& m_in, uint32_t& n_block) {
  uint32_t row0 = 0;
  uint32_t h = first == 0 ? 1u : first;
  if (group < h) group = h;
  // The ramp: a handful of groups of height first, 2 first, ... below `group`.
  while (h < group && row0 < m_blocks) {
    const uint32_t rows = h < m_blocks - row0 ? h : m_blocks - row0;
    const uint32_t tiles = rows * n_blocks;
    if (within < tiles) {
      m_in = row0 + within % rows;
      n_block = within / rows;
      return;
    }
    within -= tiles;
    row0 += rows;
    h = 2 * h < group ? 2 * h : group;
  }
  // Then groups of `group` rows (the last one shorter).
  const uint32_t per_group = group * n_blocks;
  const uint32_t g = within / per_group;
  const uint32_t local = within - g * per_group;
  const uint32_t top = row0 + g * group;
  const uint32_t rows = group < m_blocks - top ? group : m_blocks - top;
  m_in = top + local % rows;
  n_block = local / rows;
}

}  // namespace loom::kernels::tp::multinode
