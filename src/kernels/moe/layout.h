// The MoE family's tunables, its buffers (with their size formulas) and the words host and device
// share (plain data, no CUDA headers: the planner and the CPU tests use the same definitions).
//
// Symbols: W ranks of the job = N nodes x L ranks per node (ranks numbered node-major: rank
// n * L + l is local index l of node n), E experts (El = E / W per rank), k top-k, T tokens of a
// rank (at most Tmax = MoeConfig::max_tokens), C receive rows per rank (capacity), R =
// kArrivalRows, H the hidden size, rb = H * element size (a token row's bytes). Across nodes
// (N > 1): Nr = N - 1 remote nodes, K = kNetChunkTokens, Q = ceil(Tmax / K) chunks per window,
// eb = net_entry_bytes(k, rb), pb = 4 H (an fp32 partial row).
// Tr = ceil(C / 64) + El: the most tile rows of a grouped GEMM over the receive rows (any BLOCK_M
// of 64 or more).
#pragma once

#include <cstdint>

#include "kernels/moe/grouped_gemm_params.h"
#include "runtime/device_abi.h"  // LOOM_HOST_DEVICE

namespace loom::kernels::moe {

// How many 16-byte vectors of a row a reducing lane sums at once (v, v + 32, ...), of how many
// slots it issues the loads before the first fused multiply-add, and how many passes ahead it
// prefetches the rows on its own GPU into L2 (0: none): the bytes a warp keeps in flight (the
// combine's sum is latency-bound) against the registers they take (prefetches take none).
struct SumShape {
  int vectors;
  uint32_t slots;
  int ahead;
};

// Every tunable of the MoE kernels (host launchers and the planner read them too).
struct MoeTunables {
  static constexpr int kThreads = 256;  // every MoE kernel's CTA
  static constexpr int kWarps = kThreads / 32;
  // Limits (data-structure sizes, not hardware): a token's slots are the lanes of one warp;
  // destination sets are 32-bit masks; the routing keeps one histogram per warp in shared memory.
  static constexpr int kMaxTopK = 32;
  static constexpr int kMaxLocalWorld = 32;
  static constexpr int kMaxExperts = 1024;
  // Routing: one warp ranks the (token, slot) pairs of kChunkTokens consecutive tokens in order.
  static constexpr int kChunkTokens = 256;
  // Dispatch: one arrival counter (and one ready flag) per kArrivalRows receive rows; the arrival
  // role gets 1 / kArrivalShareDen of the CTAs (at least one); kCopyUnroll 16-byte vectors in
  // flight per lane while a warp copies a row.
  static constexpr int kArrivalRows = 64;
  static constexpr int kArrivalShareDen = 4;
  // An arrival CTA takes its blocks kArrivalWindow at a time, each window's in completion order
  // (a bit mask of one thread).
  static constexpr uint32_t kArrivalWindow = 32;
  static constexpr int kCopyUnroll = 4;
  // A pushing CTA sorts its tokens by their first receive row before pushing them,
  // kPushSortTokens at a time, into kPushSortBuckets buckets of at least kArrivalRows rows
  // (push_sort_bucket; the sort's shared memory: PushOrderSmem in dispatch.cuh).
  static constexpr uint32_t kPushSortTokens = 2048;
  static constexpr uint32_t kPushSortBuckets = 1024;
  // moe_dispatch_gemm: the CTAs that push (1 / kFusedPushShareDen of the grid) and complete
  // receive blocks (1 / kFusedArrivalShareDen) before they join the expert GEMM. On one rank the
  // pushing warps complete the blocks themselves (no arrival role) and the pushers get
  // 1 / kFusedPushShareDenOneRank of the grid.
  static constexpr int kFusedPushShareDen = 4;
  static constexpr int kFusedArrivalShareDen = 4;
  static constexpr int kFusedPushShareDenOneRank = 2;
  // Combine: the most CTAs (one "read done" flag each), and the shape of a reducing warp's sum
  // (SumShape: two vectors of eight slots in flight per lane, their own GPU's rows prefetched two
  // passes ahead; about 150-190 registers, in moe_combine's kernel and in moe_layer's at its entry
  // budget of 168).
  static constexpr int kMaxCtas = 1024;
  static constexpr SumShape kCombineSum{2, 8, 2};
  // Across nodes: the most ranks of a job (the routing's coordinator gives each rank one thread)
  // and nodes (combine gives each node one lane of a warp); token entries per network
  // write (one flag each); the CTAs of the forwarding role (1 / kForwardShareDen of the grid).
  static constexpr int kMaxWorld = kThreads;
  static constexpr int kMaxNodes = 32;
  static constexpr int kNetChunkTokens = 64;
  static constexpr int kForwardShareDen = 4;
  static constexpr int kFusedForwardShareDen = 8;  // moe_dispatch_gemm's (they compute afterwards)
};
static_assert(MoeTunables::kThreads % 32 == 0 && MoeTunables::kThreads >= 64,
              "MoE kernels work in whole warps and need at least two of them");
static_assert(MoeTunables::kArrivalWindow <= 32, "an arrival window's pending blocks are one 32-bit mask");
static_assert(MoeTunables::kMaxTopK <= 32, "a token's slots are the lanes of one warp: top-k cannot exceed 32");
static_assert(MoeTunables::kMaxLocalWorld <= 32, "destination sets are 32-bit masks: at most 32 local ranks");
static_assert(MoeTunables::kMaxLocalWorld <= MoeTunables::kMaxWorld && MoeTunables::kMaxWorld <= MoeTunables::kThreads,
              "the routing's coordinator gives each rank of the job one thread: kThreads must cover kMaxWorld");
static_assert(MoeTunables::kMaxNodes <= 32, "combine gives each node one lane of a warp: at most 32 nodes");
static_assert(MoeTunables::kPushSortTokens <= 65536 && MoeTunables::kPushSortBuckets <= 65536,
              "the push sort keeps token positions and buckets in 16 bits");
static_assert(MoeTunables::kMaxTopK % MoeTunables::kCombineSum.slots == 0,
              "the combine's slot batches must not run past the warp's lanes");
static_assert(MoeTunables::kPushSortBuckets % 32 == 0, "one warp scans the push sort's buckets, the same number per lane");

// The push order's bucket of a token whose smallest receive row (over its destinations: d * C +
// row, the row taken) is `first_row`, or of a token with no destination (first_row >= C): the
// last. Receive rows are expert-major and the expert GEMM takes its tiles in row order, so
// pushing the tokens bucket by bucket completes the first experts' receive blocks after a part
// of the dispatch (in token order, each expert's last block completes only at its end).
LOOM_HOST_DEVICE constexpr uint32_t push_sort_bucket(uint32_t first_row, uint32_t capacity) {
  constexpr uint32_t kBuckets = MoeTunables::kPushSortBuckets;
  constexpr uint64_t kRows = MoeTunables::kArrivalRows;
  const uint64_t blocks = (uint64_t{capacity} + kRows - 1) / kRows;
  const uint64_t width = (blocks + kBuckets - 1) / kBuckets * kRows;  // whole arrival blocks
  const uint64_t bucket = width == 0 ? 0 : first_row / width;
  return first_row >= capacity || bucket >= kBuckets ? kBuckets - 1 : static_cast<uint32_t>(bucket);
}

// What the routing found wrong with its input (MoeStatusWords::code).
enum class MoeError : int32_t {
  kNone = 0,
  kBadExpert = 1,  // an expert id outside [0, E) and not -1 (rank, token, slot, value name the first)
  kCapacity = 2,   // MoeOverflow::kError and a rank's rows exceed C (rank names it, token holds its rows)
};

// The routing's report, at the start of the plan buffer (written by the routing's coordinator
// CTA every call; dispatch and combine read `code` and `kept_rows`; moe_report copies it out).
struct MoeStatusWords {
  int32_t code;           // MoeError
  int32_t rank;           // the rank the error is about: the source of a bad id, or the rank over capacity
  int64_t token;          // kBadExpert: the token; kCapacity: that rank's rows
  int32_t slot;           // kBadExpert: the slot
  int32_t value;          // kBadExpert: the id
  int64_t recv_rows;      // rows routed to this rank
  int64_t kept_rows;      // rows in this rank's receive buffer (0 after an error)
  int64_t dropped_rows;   // recv_rows - kept_rows (kDrop)
  int64_t dropped_slots;  // this rank's pairs that found no room (kDrop; added by every routing CTA)
  int64_t max_recv_rows;  // over all ranks
  int64_t num_tokens;     // T
  uint64_t epoch;         // launch epoch of the routing
  uint64_t pad[6];
};
static_assert(sizeof(MoeStatusWords) == 128, "the status words fill 128 bytes at the start of the plan");

// One receive row's origin, written by its sender beside the row (16 bytes, one vector store).
struct alignas(16) RecvRow {
  int32_t token;    // the token's index on its source rank
  int32_t source;   // source rank (of the job) << 8 | slot
  float weight;     // the slot's router weight
  int32_t primary;  // the row that crossed NVLink for this token (== this row for the first one,
                    // and for every row a rank wrote to itself)
};
static_assert(sizeof(RecvRow) == 16, "a receive row's origin is one 16-byte store");

// A routed slot: slot_dest[t*k + j] = d * C + row (row < C on rank d), or -1 (unused, dropped, or
// the routing failed). d * C + row < W * C <= INT32_MAX (checked by the planner).
inline constexpr int32_t kNoSlot = -1;

LOOM_HOST_DEVICE constexpr uint64_t align_up(uint64_t bytes, uint64_t to) { return (bytes + to - 1) / to * to; }

// The routing's words in the count table: a header, the source's tokens bound for each node (a
// token counts once per node holding one of its experts; only read when N > 1), then the E
// expert counts.
inline constexpr uint32_t kCountHeaderInts = 4;  // code, token, slot, value of the source's first bad id
LOOM_HOST_DEVICE constexpr uint32_t count_node_word(uint32_t node) { return kCountHeaderInts + node; }
LOOM_HOST_DEVICE constexpr uint32_t count_expert_word(uint32_t nodes, uint32_t expert) {
  return kCountHeaderInts + nodes + expert;
}
LOOM_HOST_DEVICE constexpr uint32_t count_row_ints(uint32_t experts, uint32_t nodes) {
  return static_cast<uint32_t>(align_up(count_expert_word(nodes, experts), 4));
}

// Index of node `to` among node `from`'s N - 1 remote nodes (0 .. N - 2). A rank of node a keeps
// what it sends to node b at remote_slot(a, b); the receiving rank of node b keeps it at
// remote_slot(b, a) (its own index of node a), which also names the flags of those writes.
LOOM_HOST_DEVICE constexpr uint32_t remote_slot(uint32_t from, uint32_t to, uint32_t nodes) {
  return (to + nodes - from - 1) % nodes;
}
LOOM_HOST_DEVICE constexpr uint32_t remote_node(uint32_t from, uint32_t slot, uint32_t nodes) {
  return (from + 1 + slot) % nodes;
}

// A token's entry in a network window: a header, then its row (rb bytes). The header names the
// token, its source rank and, per slot j < k, the slot's destination (d * C + row, or kNoSlot when
// the slot's expert is on another node or the slot was dropped) and weight:
//   int32 token, int32 source, int32 [2] unused, int32 dest[k], fp32 weight[k]   (16-byte aligned)
inline constexpr uint32_t kNetHeaderFixedInts = 4;
LOOM_HOST_DEVICE constexpr uint64_t net_header_bytes(uint32_t top_k) { return align_up(16 + 8ull * top_k, 16); }
LOOM_HOST_DEVICE constexpr uint64_t net_entry_bytes(uint32_t top_k, uint64_t row_bytes) {
  return net_header_bytes(top_k) + row_bytes;
}
LOOM_HOST_DEVICE constexpr uint64_t net_chunks(uint64_t max_tokens) {
  return (max_tokens + MoeTunables::kNetChunkTokens - 1) / MoeTunables::kNetChunkTokens;
}
LOOM_HOST_DEVICE constexpr uint64_t routing_chunks(uint64_t tokens) {
  return (tokens + MoeTunables::kChunkTokens - 1) / MoeTunables::kChunkTokens;
}
LOOM_HOST_DEVICE constexpr uint64_t arrival_blocks(uint64_t capacity) {
  return (capacity + MoeTunables::kArrivalRows - 1) / MoeTunables::kArrivalRows;
}
// Rows of receive block f when `kept` rows are kept: kArrivalRows, fewer in the last block.
LOOM_HOST_DEVICE constexpr uint64_t block_rows(uint64_t kept, uint64_t f) {
  constexpr uint64_t kRows = MoeTunables::kArrivalRows;
  const uint64_t first = f * kRows;
  return kept <= first ? 0 : kept - first < kRows ? kept - first : kRows;
}

// How many of n items index, index + ctas, index + 2 ctas, ... fall to CTA `index` of `ctas` (the
// push and arrival roles deal their tokens and receive blocks this way).
LOOM_HOST_DEVICE constexpr uint64_t strided_share(uint64_t n, uint64_t index, uint64_t ctas) {
  return index < n ? (n - index + ctas - 1) / ctas : 0;
}

// The plan buffer (device memory of this GPU, the caller's; offsets from its start, each region
// 256-byte aligned):
//   status        MoeStatusWords                          128 B
//   slot_dest     int32 [Tmax * k]                        (kNoSlot or d * C + row)
//   slot_weight   fp32  [Tmax * k]                        the router weights (1 when none given)
//   chunk_counts  int32 [ceil(Tmax / kChunkTokens)][E]    each chunk's histogram, then its exclusive prefix
//   send_base     int32 [E]                               where this rank's rows of expert e start on its rank
//   token_nodes   u64   [Tmax] (N > 1; else empty)         the nodes holding one of token t's experts
struct PlanLayout {
  uint64_t status, slot_dest, slot_weight, chunk_counts, send_base, token_nodes, bytes;

  LOOM_HOST_DEVICE static PlanLayout make(uint64_t max_tokens, uint32_t top_k, uint32_t experts, uint32_t nodes) {
    PlanLayout l{};
    const uint64_t pairs = max_tokens * top_k;
    l.status = 0;
    l.slot_dest = align_up(sizeof(MoeStatusWords), 256);
    l.slot_weight = l.slot_dest + align_up(4 * pairs, 256);
    l.chunk_counts = l.slot_weight + align_up(4 * pairs, 256);
    l.send_base = l.chunk_counts + align_up(4 * routing_chunks(max_tokens) * experts, 256);
    l.token_nodes = l.send_base + align_up(4ull * experts, 256);
    l.bytes = l.token_nodes + (nodes > 1 ? align_up(8 * max_tokens, 256) : 0);
    return l;
  }
};

// The tile table of moe_dispatch_gemm and moe_layer over C receive rows of El local experts: the
// grouped GEMM's workspace for a contiguous layout of C rows (header, then one GroupedTileRow per tile row, sized
// for the smallest BLOCK_M so that any tile the planner picks fits).
LOOM_HOST_DEVICE constexpr uint64_t max_tile_rows(uint64_t capacity, uint64_t local_experts) {
  return grouped_max_tile_rows(GroupedRows::kContiguous, capacity, local_experts, GroupedGemmTunables::kMinBlockM);
}
LOOM_HOST_DEVICE constexpr uint64_t tile_table_bytes(uint64_t capacity, uint64_t local_experts) {
  return kGroupedWorkspaceHeaderBytes + sizeof(GroupedTileRow) * max_tile_rows(capacity, local_experts);
}

// moe_layer's shared expert (kernels/moe/layer.cuh) computes on rows of its own after the receive
// rows, in the same `hidden` and `expert_out` buffers: token t's rows are row
// layer_shared_row_begin(C) + t, the first a multiple of every BLOCK_M (no tile straddles the
// routed and shared rows). Its tile rows come before the routed ones in the layer's counters
// (virtual tile rows [0, S)): at most layer_shared_tile_rows(Tmax) of them (the smallest BLOCK_M).
inline constexpr uint64_t kLayerSharedRowAlign = 128;
LOOM_HOST_DEVICE constexpr uint64_t layer_shared_row_begin(uint64_t capacity) {
  return align_up(capacity, kLayerSharedRowAlign);
}
// Rows of moe_layer's hidden and expert_out: C, or with a shared expert align_up(C, 128) + Tmax.
LOOM_HOST_DEVICE constexpr uint64_t layer_rows(uint64_t capacity, uint64_t max_tokens, bool shared_expert) {
  return shared_expert ? layer_shared_row_begin(capacity) + max_tokens : capacity;
}
LOOM_HOST_DEVICE constexpr uint64_t layer_shared_tile_rows(uint64_t max_tokens) {
  return (max_tokens + GroupedGemmTunables::kMinBlockM - 1) / GroupedGemmTunables::kMinBlockM;
}

// The shape the MoE workspace is laid out for (every rank computes the same layout).
struct MoeShape {
  uint32_t world = 1;       // W = N * L
  uint32_t nodes = 1;       // N
  uint32_t experts = 0;     // E
  uint32_t top_k = 1;       // k
  uint64_t max_tokens = 0;  // Tmax
  uint64_t capacity = 0;    // C
  uint64_t row_bytes = 0;   // rb
  uint64_t hidden = 0;      // H

  LOOM_HOST_DEVICE uint32_t local_world() const { return world / nodes; }
  LOOM_HOST_DEVICE uint32_t remote_nodes() const { return nodes - 1; }
};

// The MoE family's symmetric workspace (ops::family_workspace "moe"; equal offsets on every rank;
// offsets from its start, each region 256-byte aligned). Who writes each region, and which call
// zeroes it in stream order just before its kernel (peers write into a rank only after its entry
// word of that launch, so after the zeroing; every region a kernel waits on is zeroed first, so
// no value left by another call or an earlier layout can pass a wait). Regions marked (N > 1) are
// empty on a single node.
//   count_table  int32 [W][count_row_ints(E, N)]  row s written by rank s (NVLink, or its
//                                               same-index GPU forwards it)              routing
//   count_flags  u64   [W]                      epoch: "row s is complete"                routing
//   node_tokens  int32 [N]                      this rank's tokens bound for node n (local)  routing
//   chunk_flags  u64   [ceil(Tmax / kChunkTokens)]  epoch: chunk c counted (local)        routing
//   routing_words u64  [4]                      0: layout ready (epoch, local); 1: ~smallest bad pair  routing
//   arrival      u64   [ceil(C / R)]            counters: rows of block f landed (any rank adds 1 per row)  dispatch
//   ready        u64   [ceil(C / R)]            epoch: block f complete, repeats copied (local)  dispatch
//   send_fill    u32   [Nr]  (N > 1)            positions taken in the send window of each remote node  dispatch
//   sent_chunks  u64   [Nr]  (N > 1)            chunks of each window handed to the proxy (a counter)  dispatch
//   send_count   u32   [Nr][Q]  (N > 1)         entries written into each chunk of a window     dispatch
//   pushes_done  u64   [1]                      moe_layer: push CTAs done (their token_pos written)  dispatch
//   hidden_done  u64   [Ts + Tr]                moe_layer: fc1 tiles of tile row r finished (local counters)  layer
//   out_done     u64   [Ts + Tr]                moe_layer: fc2 tiles of tile row r finished (local counters)  layer
//   out_ready    u64   [Cl]                     moe_layer: epoch: "expert output row j is final" (peers read)  layer
//                (Ts = layer_shared_tile_rows(Tmax), the shared expert's tile rows; Cl =
//                 layer_rows(C, Tmax, true): room for a shared expert whether or not a call has one)
//   read_done    u64   [kMaxCtas]               epoch: CTA i of combine has read (local)  combine
//   done         u64   [L]                      epoch: "local rank l has read my expert outputs"  combine
//   ret_count    u32   [Nr][Q]  (N > 1)         partial rows written into each chunk of a return window  combine
//   ret_sent     u64   [Nr]  (N > 1)            return chunks handed to the proxy (a counter)  combine
//   rows         RecvRow [C]                    each receive row's origin (its sender)    never (written before read)
//   tiles        16 B x (1 + Tr), Tr = ceil(C / 64) + El   the tile table of moe_dispatch_gemm and
//                                               moe_layer (local, El = E / W):
//                                               the grouped GEMM's workspace over the receive rows
//                                               (kernels/moe/grouped_gemm_params.h)     never (its plan
//                                                                                       kernel rewrites it)
//   staged_epoch u64   [1]  (N > 1)             the routing epoch of the plan whose dispatch filled
//                                               `staging` (combine checks it)           never
//   token_pos    int32 [Tmax][Nr]  (N > 1)      token t's position in the send window of remote slot i  never
//   send_window  [Nr][Tmax] x eb  (N > 1)       token entries for each remote node (the network source)  never
//   staging      [Nr][Tmax] x eb  (N > 1)       token entries from each remote node's same-index rank   never
//   ret_window   [Nr][Tmax] x pb  (N > 1)       fp32 partial sums of the staged tokens, to return  never
//   partials     [Nr][Tmax] x pb  (N > 1)       fp32 partial sums of this rank's tokens from each remote node  never
// Network flags (the network flag window's per-launch words, from launch_base): routing: word i
// = "the count row from remote slot i arrived"; dispatch: word i * Q + c = "chunk c of the entries
// from remote slot i arrived"; combine: the same for partial rows. net_flag_words() of them.
struct WorkspaceLayout {
  uint64_t count_table, count_flags, node_tokens, chunk_flags, routing_words, arrival, ready, send_fill, sent_chunks,
      send_count, pushes_done, hidden_done, out_done, out_ready, read_done, done, ret_count, ret_sent, rows, tiles, staged_epoch,
      token_pos, send_window, staging, ret_window, partials, bytes;
  uint64_t entry_bytes;    // eb (0 when N = 1)
  uint64_t partial_bytes;  // pb (0 when N = 1)
  uint32_t window_chunks;  // Q (0 when N = 1)

  LOOM_HOST_DEVICE static WorkspaceLayout make(const MoeShape& s) {
    WorkspaceLayout l{};
    const uint64_t blocks = arrival_blocks(s.capacity);
    const bool net = s.nodes > 1;
    const uint64_t remote = s.nodes - 1;
    l.window_chunks = net ? static_cast<uint32_t>(net_chunks(s.max_tokens)) : 0;
    l.entry_bytes = net ? net_entry_bytes(s.top_k, s.row_bytes) : 0;
    l.partial_bytes = net ? 4 * s.hidden : 0;
    const uint64_t q = l.window_chunks;
    l.count_table = 0;
    l.count_flags = l.count_table + align_up(4ull * s.world * count_row_ints(s.experts, s.nodes), 256);
    l.node_tokens = l.count_flags + align_up(8ull * s.world, 256);
    l.chunk_flags = l.node_tokens + align_up(4ull * s.nodes, 256);
    l.routing_words = l.chunk_flags + align_up(8 * routing_chunks(s.max_tokens), 256);
    l.arrival = l.routing_words + 256;
    l.ready = l.arrival + align_up(8 * blocks, 256);
    l.send_fill = l.ready + align_up(8 * blocks, 256);
    l.sent_chunks = l.send_fill + align_up(4 * remote, 256);
    l.send_count = l.sent_chunks + align_up(8 * remote, 256);
    const uint64_t tile_rows = max_tile_rows(s.capacity, s.experts / s.world);
    const uint64_t layer_tile_rows = layer_shared_tile_rows(s.max_tokens) + tile_rows;
    l.pushes_done = l.send_count + align_up(4 * remote * q, 256);
    l.hidden_done = l.pushes_done + 256;
    l.out_done = l.hidden_done + align_up(8 * layer_tile_rows, 256);
    l.out_ready = l.out_done + align_up(8 * layer_tile_rows, 256);
    l.read_done = l.out_ready + align_up(8 * layer_rows(s.capacity, s.max_tokens, true), 256);
    l.done = l.read_done + align_up(8ull * MoeTunables::kMaxCtas, 256);
    l.ret_count = l.done + align_up(8ull * s.local_world(), 256);
    l.ret_sent = l.ret_count + align_up(4 * remote * q, 256);
    l.rows = l.ret_sent + align_up(8 * remote, 256);
    l.tiles = l.rows + align_up(sizeof(RecvRow) * s.capacity, 256);
    l.staged_epoch = l.tiles + align_up(tile_table_bytes(s.capacity, s.experts / s.world), 256);
    l.token_pos = l.staged_epoch + (net ? 256 : 0);
    l.send_window = l.token_pos + align_up(4 * s.max_tokens * remote, 256);
    l.staging = l.send_window + align_up(remote * s.max_tokens * l.entry_bytes, 256);
    l.ret_window = l.staging + align_up(remote * s.max_tokens * l.entry_bytes, 256);
    l.partials = l.ret_window + align_up(remote * s.max_tokens * l.partial_bytes, 256);
    l.bytes = l.partials + align_up(remote * s.max_tokens * l.partial_bytes, 256);
    return l;
  }
  // The byte ranges each call zeroes before its kernel (moe_layer: from dispatch_zero_begin to
  // combine_zero_end, the layer regions between them included).
  LOOM_HOST_DEVICE uint64_t routing_zero_begin() const { return count_table; }
  LOOM_HOST_DEVICE uint64_t routing_zero_end() const { return arrival; }
  LOOM_HOST_DEVICE uint64_t dispatch_zero_begin() const { return arrival; }
  LOOM_HOST_DEVICE uint64_t dispatch_zero_end() const { return hidden_done; }
  LOOM_HOST_DEVICE uint64_t combine_zero_begin() const { return read_done; }
  LOOM_HOST_DEVICE uint64_t combine_zero_end() const { return rows; }
  // Per-launch words of the network flag window a call uses (the largest of the three calls').
  LOOM_HOST_DEVICE static uint64_t net_flag_words(const MoeShape& s) {
    const uint64_t q = net_chunks(s.max_tokens);
    return s.nodes > 1 ? (s.nodes - 1) * (q > 1 ? q : 1) : 0;
  }
};

// Words of the routing_words region.
inline constexpr uint32_t kLayoutReadyWord = 0;
inline constexpr uint32_t kFirstBadWord = 1;

}  // namespace loom::kernels::moe
