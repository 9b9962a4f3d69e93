// moe_dispatch: every routed token row to the ranks holding its experts, into the receive layout
// the routing computed (kernels/moe/routing.cuh): the roles of one persistent kernel on the frame
// (moe_dispatch_kernel, dispatch_kernel.cuh; moe_dispatch_gemm runs them too, dispatch_gemm.cuh).
//
// Roles (DispatchRoleTable): CTAs [0, arrival_ctas) receive, on several nodes the next
// forward_ctas forward, the rest push.
//   push     CTA i of the P pushing CTAs takes tokens i, i + P, ..., one warp per token; in the
//            fused kernels in the order of their first receive rows (push_role: a counting sort
//            per CTA, so the first experts' receive blocks complete first); for each destination rank
//            d among the token's routed slots (once per rank, whatever the number of its experts
//            there): waits (bounded, once per warp and rank) for d's entry word of this launch,
//            copies the row with 16-byte vector stores into its FIRST row on d (the primary: the
//            smallest of its rows there, as the layout is expert-major), writes the RecvRow origin
//            of each of its rows on d (token, source rank and slot, weight, primary), fences (at
//            GPU scope when d is this rank, else at system scope), and adds 1 to d's arrival
//            counter of each of those rows' blocks (on one rank, the add that completes a block
//            also sets its ready flag: no arrival role).
//            So a token crosses NVLink once per destination rank. To this rank itself (every
//            token at W = 1) the warp writes all of the token's rows, each its own primary: there
//            is no link to spare, and the arrival role need not read a primary back. On several
//            nodes, for every other node holding one of its experts, the warp writes the token's
//            entry (header: token, source, its slots there and their weights; then the row) into
//            this rank's send window toward that node and counts it; the entry completing a chunk of
//            kNetChunkTokens hands the chunk to the proxy (net_window.cuh): one network write to
//            this rank's same-index GPU there, then the chunk's flag.
//   forward  (several nodes) warp w takes the chunks (remote slot, chunk) w, w + warps, ... that
//            the same-index GPUs of other nodes send this rank: waits (bounded) for the chunk's
//            network flag, then pushes each entry's row to its ranks on this node exactly as a
//            pushing warp does (push_local_slots), so the arrival role sees no difference. CTA 0
//            announces the network entry first and, at the end, records the plan's routing
//            epoch (combine checks it) and waits until this rank's windows were all sent.
//   arrival  (W >= 2; nothing to do on one rank) CTA i of the arrival role takes receive blocks
//            f = i, i + arrival_ctas, ... of this rank's kept rows (R = kArrivalRows rows each):
//            waits (bounded) until arrival[f] holds the block's row count (every row's sender
//            has added its 1, so every primary row in the block has landed and every other row's
//            origin is there, its primary landed too, being no later in the order), copies each
//            repeated row from its primary (local copies), then sets ready[f] = e. A kernel
//            reading this rank's rows (the grouped GEMM of the fused moe_dispatch_gemm,
//            dispatch_gemm.cuh) gates on ready[].
//            When its blocks are done every row sent to this rank has landed, so the launch ends
//            only after every write into this rank (the frame's rule).
// Counters are the one non-epoch word: zeroed by the host call before the kernel (stream order),
// added to only after this rank's entry of the launch, read back against the block's row count.
//
// Buffers (heap offsets equal on all ranks; layout in kernels/moe/layout.h):
//   x        [T, H] this rank's tokens (local)
//   recv_x   [C, H] symmetric: rows [0, kept) in the receive layout, the rest untouched
//   rows     RecvRow [C] in the MoE workspace; arrival / ready [ceil(C / R)] there too
//   send_window, staging, token_pos, send_fill / sent_chunks / send_count   several nodes only
//            (sizes in layout.h)
#pragma once

#include <cuda/atomic>

#include <cstdint>

#include "kernels/comm/copy.cuh"
#include "kernels/comm/entry.cuh"
#include "kernels/comm/signals.cuh"
#include "kernels/comm/wait.cuh"
#include "kernels/common/warp_scan.cuh"
#include "kernels/frame/persistent.cuh"
#include "kernels/frame/role_table.h"
#include "kernels/moe/common.cuh"
#include "kernels/moe/flags.h"
#include "kernels/moe/layout.h"
#include "kernels/moe/net_window.cuh"

namespace loom::kernels::moe {

enum class DispatchRole : uint32_t {
  kArrival = 0,  // waits for this rank's receive blocks, copies repeated tokens, sets ready[]
  kForward = 1,  // several nodes: pushes the token entries that arrive from other nodes to their ranks here
  kPush = 2,     // pushes this rank's token rows to their destination ranks (or nodes)
};
using DispatchRoleTable = frame::RoleTable<DispatchRole, DispatchRole::kPush>;

struct DispatchParams : LaunchCommon {
  PlanView plan;                 // the routing's
  const uint64_t* token_nodes;   // [T] the routing's (several nodes; null on one)
  const char* x;                 // [T, H]
  uint64_t recv_offset;          // heap offset of recv_x
  uint64_t row_bytes;            // H * element size (a multiple of 16)
  uint32_t num_tokens;           // T
  uint32_t top_k;
  uint32_t capacity;             // C
  uint32_t max_tokens;           // Tmax (the network windows' entries)
  uint32_t num_experts;          // E
  uint32_t signature;
  uint32_t net_flag_base;        // the network window's first per-launch word (several nodes)
  DispatchRoleTable roles;
};
static_assert(sizeof(DispatchParams) <= 4096, "moe_dispatch's parameters must fit the classic 4 KiB limit");

// A warp's running state while it pushes: the local ranks (bits) and nodes (bits, lane 0's) whose
// entry it has seen.
struct PushState {
  uint32_t entered;      // lane-uniform
  uint64_t net_entered;  // lane 0's
};

// Who completes the receive blocks: on one rank the pushing warps (every row is pushed here by
// this launch, each its own primary, so a block is complete with its last row's add), else the
// arrival role (rows from peers and other nodes, repeats to copy).
__device__ __forceinline__ bool pushers_complete_blocks(const DeviceComm& c) { return JobRanks(c).world() == 1; }

// One warp: a token row at `src` (memory of this GPU: x, or a staged entry) to local rank `d` of
// this node: copied into its primary row there (the smallest of the rows `mine` lanes hold: a
// token crosses NVLink once per rank), the origin of each of those rows written beside it, then
// d's arrival counter of each row's block raised. Lane j with `mine` holds slot j's `row` on d and
// `weight`. False after a failed wait (recorded).
__device__ __forceinline__ bool push_row(const DispatchParams& p, uint32_t d, bool mine, uint32_t row, float weight,
                                         int32_t token, int32_t source, const char* src, PushState& s, uint64_t epoch,
                                         const WaitContext& ctx) {
  const DeviceComm& c = p.comm;
  const WorkspaceLayout& l = p.ws.layout;
  const uint32_t lane = lane_id();
  const uint32_t primary = __reduce_min_sync(0xffffffffu, mine ? row : 0xffffffffu);
  if ((s.entered & (1u << d)) == 0) {
    bool ok = true;
    if (lane == 0) ok = wait_entry(c, moe_entry(c), static_cast<int>(d), epoch, p.signature, ctx);
    if (!__shfl_sync(0xffffffffu, ok, 0)) return false;
    __syncwarp();  // the warp's stores into d are ordered after lane 0's acquire of its entry
    s.entered |= 1u << d;
  }
  char* recv = reinterpret_cast<char*>(c.peer_heap_bases[d] + p.recv_offset);
  // This GPU (d is this rank; at W = 1 every token): no link to spare, so the warp writes every
  // row of the token itself, each its own primary (the arrival role copies none of them), rather
  // than one row for the arrival role to read back and copy k - 1 times.
  const bool own = d == static_cast<uint32_t>(c.local_rank);
  if (own) {
    vector_copy_to_rows<MoeTunables::kCopyUnroll>(recv + static_cast<uint64_t>(row) * p.row_bytes,
                                                  __ballot_sync(0xffffffffu, mine), src, p.row_bytes, lane);
  } else {
    vector_copy<MoeTunables::kCopyUnroll>(recv + static_cast<uint64_t>(primary) * p.row_bytes, src, p.row_bytes, lane, 32);
  }
  if (mine) {
    const RecvRow origin{token, (source << 8) | static_cast<int32_t>(lane), weight,
                         static_cast<int32_t>(own ? row : primary)};
    *p.ws.at<RecvRow>(c, static_cast<int>(d), l.rows, row) = origin;
  }
  // Rows on this rank are read only by this GPU (its arrival role, its GEMM's TMA loads after the
  // gate's proxy fence), so a GPU-scope fence orders them; rows on a peer need system scope.
  if (own) {
    __threadfence();
  } else {
    __threadfence_system();
  }
  __syncwarp();
  if (mine) {
    const uint32_t f = row / MoeTunables::kArrivalRows;
    uint64_t* arrived = p.ws.at<uint64_t>(c, static_cast<int>(d), l.arrival, f);
    if (pushers_complete_blocks(c)) {
      // The add that completes a block marks it ready (the acq_rel add takes in every earlier row
      // of the block); nothing is left to copy, and no arrival role runs.
      const uint64_t before = cuda::atomic_ref<uint64_t, cuda::thread_scope_device>(*arrived).fetch_add(
          1, cuda::memory_order_acq_rel);
      if (before + 1 == block_rows(kept_rows(*p.plan.status, p.capacity), f)) {
        flag_store_release(p.ws.at<uint64_t>(c, static_cast<int>(d), l.ready, f), epoch);
      }
    } else {
      counter_add_release(arrived, 1);
    }
  }
  return true;
}

// One warp: the slots of one token whose destinations are on this node (lane j: slot j's `dest`,
// d * C + row, or kNoSlot; `weight`), grouped by rank, each group through push_row.
__device__ __forceinline__ bool push_local_slots(const DispatchParams& p, const JobRanks& r, int32_t dest, float weight,
                                                 int32_t token, int32_t source, const char* src, PushState& s,
                                                 uint64_t epoch, const WaitContext& ctx) {
  const uint32_t cap = p.capacity;
  const uint32_t owner = dest != kNoSlot ? static_cast<uint32_t>(dest) / cap : 0;
  const uint32_t row = dest != kNoSlot ? static_cast<uint32_t>(dest) - owner * cap : 0;
  const bool here = dest != kNoSlot && r.node_of(owner) == r.node;
  uint32_t pending = __ballot_sync(0xffffffffu, here);
  while (pending != 0) {
    const uint32_t d = __shfl_sync(0xffffffffu, owner, __ffs(pending) - 1);
    const bool mine = here && owner == d;
    if (!push_row(p, r.local_of(d), mine, row, weight, token, source, src, s, epoch, ctx)) return false;
    pending &= ~__ballot_sync(0xffffffffu, mine);
  }
  return true;
}

// The tokens this rank's row of the count table says `source` sends to node n.
__device__ __forceinline__ uint32_t tokens_to_node(const LaunchCommon& p, uint32_t experts, uint32_t nodes,
                                                   uint32_t source, uint32_t n) {
  const int32_t* table = p.ws.at<int32_t>(p.comm, p.comm.local_rank, p.ws.layout.count_table);
  const int32_t v = table[static_cast<uint64_t>(source) * count_row_ints(experts, nodes) + count_node_word(n)];
  return v > 0 ? static_cast<uint32_t>(v) : 0u;
}

// This rank's network window toward node n (remote slot i of this rank).
__device__ __forceinline__ NetWindow dispatch_window(const DispatchParams& p, const JobRanks& r, uint32_t n) {
  const WorkspaceLayout& l = p.ws.layout;
  const DeviceComm& c = p.comm;
  const uint32_t i = remote_slot(r.node, n, r.nodes);
  const uint32_t at_peer = remote_slot(n, r.node, r.nodes);  // the receiver's slot of this node
  NetWindow w;
  w.chunk_count = p.ws.at<uint32_t>(c, c.local_rank, l.send_count, static_cast<uint64_t>(i) * l.window_chunks);
  w.sent = p.ws.at<uint64_t>(c, c.local_rank, l.sent_chunks, i);
  w.src_offset = p.ws.offset + l.send_window + static_cast<uint64_t>(i) * p.max_tokens * l.entry_bytes;
  w.dst_offset = p.ws.offset + l.staging + static_cast<uint64_t>(at_peer) * p.max_tokens * l.entry_bytes;
  w.entry_bytes = l.entry_bytes;
  w.entries = tokens_to_node(p, p.num_experts, r.nodes, r.position(), n);
  w.flag_base = p.net_flag_base + at_peer * l.window_chunks;
  w.node = static_cast<int>(n);
  w.peer = net_rank_of(c, static_cast<int>(n), c.local_rank);
  return w;
}


// One warp: token t's entry in this rank's window toward node n (its slots there, the row), then
// the window's chunk count. False after a failed wait (recorded).
__device__ __forceinline__ bool send_to_node(const DispatchParams& p, const JobRanks& r, uint32_t t, uint32_t n,
                                             int32_t dest, float weight, PushState& s, const WaitContext& ctx) {
  const DeviceComm& c = p.comm;
  const WorkspaceLayout& l = p.ws.layout;
  const uint32_t lane = lane_id();
  const NetWindow w = dispatch_window(p, r, n);
  const uint32_t i = remote_slot(r.node, n, r.nodes);
  uint32_t pos = 0;
  if (lane == 0) pos = atomicAdd(p.ws.at<uint32_t>(c, c.local_rank, l.send_fill, i), 1u);
  pos = __shfl_sync(0xffffffffu, pos, 0);
  char* entry = reinterpret_cast<char*>(c.local_heap_base + w.src_offset) + static_cast<uint64_t>(pos) * l.entry_bytes;
  int32_t* header = reinterpret_cast<int32_t*>(entry);
  const bool there = dest != kNoSlot && r.node_of(static_cast<uint32_t>(dest) / p.capacity) == n;
  if (lane == 0) {
    header[0] = static_cast<int32_t>(t);
    header[1] = static_cast<int32_t>(r.position());
    *p.ws.at<int32_t>(c, c.local_rank, l.token_pos, static_cast<uint64_t>(t) * (r.nodes - 1) + i) = static_cast<int32_t>(pos);
  }
  if (lane < p.top_k) {
    header[kNetHeaderFixedInts + lane] = there ? dest : kNoSlot;
    reinterpret_cast<float*>(header)[kNetHeaderFixedInts + p.top_k + lane] = there ? weight : 0.0f;
  }
  vector_copy<MoeTunables::kCopyUnroll>(entry + net_header_bytes(p.top_k), p.x + static_cast<uint64_t>(t) * p.row_bytes,
                                        p.row_bytes, lane, 32);
  __threadfence_system();
  __syncwarp();
  bool ok = true;
  if (lane == 0) ok = net_window_written(c, w, pos, p.signature, s.net_entered, ctx);
  return __shfl_sync(0xffffffffu, ok, 0);
}

// One warp: every destination of token t: the ranks of this node directly, each other node holding
// one of its experts once, through the window toward it (its same-index GPU there forwards).
// `net`: several nodes and a routing that did not fail. False after a failed wait (recorded).
__device__ __forceinline__ bool push_token(const DispatchParams& p, const JobRanks& r, uint32_t t, bool net,
                                           PushState& s, uint64_t epoch, const WaitContext& ctx) {
  const uint32_t lane = lane_id();
  const uint64_t q = static_cast<uint64_t>(t) * p.top_k + lane;
  const int32_t dest = lane < p.top_k ? valid_slot(p.plan.slot_dest[q], r.world(), p.capacity) : kNoSlot;
  const float weight = lane < p.top_k ? p.plan.slot_weight[q] : 0.0f;
  const char* row = p.x + static_cast<uint64_t>(t) * p.row_bytes;
  if (!push_local_slots(p, r, dest, weight, static_cast<int32_t>(t), static_cast<int32_t>(r.position()), row, s, epoch, ctx)) {
    return false;
  }
  if (!net) return true;
  // Every node holding one of the token's experts gets its entry, even one whose slots were all
  // dropped (kDrop): the windows' sizes come from the routing's counts.
  for (uint64_t m = p.token_nodes[t] & ~(1ull << r.node); m != 0; m &= m - 1) {
    if (!send_to_node(p, r, t, static_cast<uint32_t>(__ffsll(static_cast<long long>(m)) - 1), dest, weight, s, ctx)) {
      return false;
    }
  }
  return true;
}

// A pushing CTA's counting sort of one batch of its tokens (shared memory; B = kPushSortBuckets,
// S = kPushSortTokens; 4 B + 6 S bytes, 16 KiB):
//   bucket_start  B x 4 B   tokens per bucket, then (scanned) each bucket's first position
//   bucket        S x 2 B   batch token j's bucket (push_sort_bucket)
//   rank          S x 2 B   its position among the batch's tokens of that bucket
//   order         S x 2 B   the batch's tokens j, bucket by bucket
struct PushOrderSmem {
  uint32_t bucket_start[MoeTunables::kPushSortBuckets];
  uint16_t bucket[MoeTunables::kPushSortTokens];
  uint16_t rank[MoeTunables::kPushSortTokens];
  uint16_t order[MoeTunables::kPushSortTokens];
};

// Token t's push bucket: its smallest receive row over its destinations.
__device__ __forceinline__ uint32_t token_push_bucket(const DispatchParams& p, uint32_t world, uint32_t t) {
  uint32_t first_row = 0xffffffffu;
  for (uint32_t j = 0; j < p.top_k; ++j) {
    const int32_t dest = valid_slot(p.plan.slot_dest[static_cast<uint64_t>(t) * p.top_k + j], world, p.capacity);
    if (dest != kNoSlot) first_row = min(first_row, static_cast<uint32_t>(dest) % p.capacity);
  }
  return push_sort_bucket(first_row, p.capacity);
}

// One warp: `v[0, n)` (n a multiple of 32) replaced by its exclusive prefix sums.
__device__ __forceinline__ void warp_exclusive_scan(uint32_t* v, uint32_t n) {
  const uint32_t lane = lane_id();
  const uint32_t per = n / 32;
  uint32_t* mine = v + lane * per;
  uint32_t sum = 0;
  for (uint32_t i = 0; i < per; ++i) sum += mine[i];
  uint32_t running = warp_inclusive_sum(sum) - sum;
  for (uint32_t i = 0; i < per; ++i) {
    const uint32_t count = mine[i];
    mine[i] = running;
    running += count;
  }
}

// The pushing role of CTA `index` of `ctas` (all threads, any whole number of warps): tokens
// index, index + ctas, ..., kPushSortTokens at a time, each token by one warp (push_token). With
// `sort` (the fused kernels, whose GEMM takes receive blocks in row order as they complete), a
// batch with more tokens than the CTA has warps is pushed in push_sort_bucket order (a counting
// sort in `sort`; within a bucket in any order: the receive layout, not the push order, decides
// every row); without (moe_dispatch, whose rows are read only after the launch) in index order.
// The result is the same either way; the order decides how early each receive block completes.
// False after a failed wait (recorded).
__device__ __forceinline__ bool push_role(const DispatchParams& p, uint32_t index, uint32_t ctas, PushOrderSmem* sort,
                                          uint64_t epoch, const WaitContext& ctx) {
  constexpr uint32_t kBatch = MoeTunables::kPushSortTokens;
  constexpr uint32_t kBuckets = MoeTunables::kPushSortBuckets;
  const DeviceComm& c = p.comm;
  const JobRanks r(c);
  const uint32_t warps = blockDim.x / 32;
  const uint32_t mine = static_cast<uint32_t>(strided_share(p.num_tokens, index, ctas));
  const bool net = p.token_nodes != nullptr && p.plan.status->code == 0;  // a failed routing moves nothing
  PushState s{1u << c.local_rank, 0};
  for (uint32_t begin = 0; begin < mine; begin += kBatch) {
    const uint32_t count = min(kBatch, mine - begin);
    const bool sorted = sort != nullptr && count > warps;
    if (sorted) {
      for (uint32_t b = threadIdx.x; b < kBuckets; b += blockDim.x) sort->bucket_start[b] = 0;
      __syncthreads();
      for (uint32_t j = threadIdx.x; j < count; j += blockDim.x) {
        const uint32_t b = token_push_bucket(p, r.world(), index + (begin + j) * ctas);
        sort->bucket[j] = static_cast<uint16_t>(b);
        sort->rank[j] = static_cast<uint16_t>(atomicAdd(&sort->bucket_start[b], 1u));
      }
      __syncthreads();
      if (warp_id() == 0) warp_exclusive_scan(sort->bucket_start, kBuckets);
      __syncthreads();
      for (uint32_t j = threadIdx.x; j < count; j += blockDim.x) {
        sort->order[sort->bucket_start[sort->bucket[j]] + sort->rank[j]] = static_cast<uint16_t>(j);
      }
      __syncthreads();
    }
    bool ok = true;
    for (uint32_t i = warp_id(); ok && i < count; i += warps) {
      const uint32_t j = sorted ? sort->order[i] : i;
      ok = push_token(p, r, index + (begin + j) * ctas, net, s, epoch, ctx);
    }
    if (!cta_all(ok)) return false;  // also: every warp has read `order` before the next batch rewrites it
  }
  return true;
}

// One forwarding warp (several nodes): chunks of the token entries that this rank's same-index
// GPUs on other nodes sent it, items first, first + stride, ... over (remote slot, chunk); waits
// (bounded) for each chunk's network flag, then pushes every entry's row to its ranks on this node
// exactly as their sender would (push_local_slots). False after a failed wait (recorded).
__device__ __forceinline__ bool forward_entries(const DispatchParams& p, uint32_t first, uint32_t stride, uint64_t epoch,
                                                const WaitContext& ctx) {
  constexpr uint32_t kChunk = MoeTunables::kNetChunkTokens;
  const DeviceComm& c = p.comm;
  const WorkspaceLayout& l = p.ws.layout;
  const JobRanks r(c);
  const uint32_t lane = lane_id();
  const uint64_t header_bytes = net_header_bytes(p.top_k);
  if (p.plan.status->code != 0) return true;  // a failed routing moves nothing
  PushState s{1u << c.local_rank, 0};
  uint32_t item0 = 0;  // items of the remote slots before i
  for (uint32_t i = 0; i + 1 < r.nodes; ++i) {
    const uint32_t from = remote_node(r.node, i, r.nodes);
    const uint32_t source = r.peer_on(from);
    const int sender = net_rank_of(c, static_cast<int>(from), c.local_rank);
    const uint32_t entries = tokens_to_node(p, p.num_experts, r.nodes, source, r.node);
    const uint32_t chunks = window_chunks(entries);
    const char* window = p.ws.base(c, c.local_rank) + l.staging + static_cast<uint64_t>(i) * p.max_tokens * l.entry_bytes;
    // This warp's items of this slot: the global items first, first + stride, ... in [item0, item0 + chunks).
    const uint32_t start = first >= item0 ? first : item0 + (stride - (item0 - first) % stride) % stride;
    for (uint32_t item = start; item < item0 + chunks; item += stride) {
      const uint32_t chunk = item - item0;
      bool ok = true;
      if (lane == 0) ok = net_wait(c, p.net_flag_base + i * l.window_chunks + chunk, sender, ctx);
      if (!__shfl_sync(0xffffffffu, ok, 0)) return false;
      const uint32_t end = min(entries, (chunk + 1) * kChunk);
      for (uint32_t e = chunk * kChunk; e < end; ++e) {
        const char* entry = window + static_cast<uint64_t>(e) * l.entry_bytes;
        const int32_t* header = reinterpret_cast<const int32_t*>(entry);
        const int32_t token = header[0];
        const int32_t from = header[1];
        const int32_t dest = lane < p.top_k ? valid_slot(header[kNetHeaderFixedInts + lane], r.world(), p.capacity) : kNoSlot;
        const float weight = lane < p.top_k ? reinterpret_cast<const float*>(header)[kNetHeaderFixedInts + p.top_k + lane] : 0.0f;
        if (!push_local_slots(p, r, dest, weight, token, from, entry + header_bytes, s, epoch, ctx)) return false;
      }
    }
    item0 += chunks;
  }
  return true;
}

// The forwarding role's last duty (one thread of its first CTA, several nodes): record which
// plan's tokens are staged here (combine checks it), then wait until every chunk of this rank's
// windows was handed to the proxy and sent. False after a failed wait (recorded).
__device__ __forceinline__ bool finish_sends(const DispatchParams& p, const WaitContext& ctx) {
  const DeviceComm& c = p.comm;
  const WorkspaceLayout& l = p.ws.layout;
  const JobRanks r(c);
  *p.ws.at<uint64_t>(c, c.local_rank, l.staged_epoch) = p.plan.status->epoch;
  if (p.plan.status->code != 0) return true;
  return net_windows_drained(
      c, p.ws.at<uint64_t>(c, c.local_rank, l.sent_chunks), r.nodes - 1,
      [&](uint32_t i) {
        return window_chunks(tokens_to_node(p, p.num_experts, r.nodes, r.position(), remote_node(r.node, i, r.nodes)));
      },
      kSentFlag, ctx);
}

// The forwarding role of CTA `index` of `ctas` (all threads, any whole number of warps; several
// nodes): CTA 0 announces this rank's network entry first (the other nodes' ranks send their
// entries only after it), every CTA forwards its chunks, then CTA 0 runs finish_sends. False
// after a failed wait (recorded).
__device__ __forceinline__ bool forward_role(const DispatchParams& p, uint32_t index, uint32_t ctas,
                                             const frame::LaunchFrame& f) {
  bool ok = index != 0 || threadIdx.x != 0 || announce_network_entry(p.comm, EntryPeers::kAll, p.signature, f.ctx);
  if (!cta_all(ok)) return false;
  const uint32_t warps = blockDim.x / 32;
  ok = cta_all(forward_entries(p, index * warps + warp_id(), ctas * warps, f.epoch, f.ctx));
  if (ok && index == 0 && threadIdx.x == 0) ok = finish_sends(p, f.ctx);
  return cta_all(ok);
}

// One arrival CTA (all threads, any whole number of warps): blocks first, first + stride, ... of
// this rank's kept rows, kArrivalWindow at a time. Within a window the CTA takes whichever block
// is complete first (thread 0 waits, bounded, until any pending block of the window is), so a
// block whose rows come late (a receive block is complete only when the last of its tokens is
// pushed) holds back none of the others. `pick` is a word of shared memory. False after a failed
// wait (recorded).
__device__ __forceinline__ bool receive_blocks(const DispatchParams& p, uint32_t first, uint32_t stride, uint64_t epoch,
                                               const WaitContext& ctx, volatile uint32_t* pick) {
  constexpr uint32_t kWindow = MoeTunables::kArrivalWindow;
  constexpr uint32_t kFailed = 0xffffffffu;
  const DeviceComm& c = p.comm;
  const WorkspaceLayout& l = p.ws.layout;
  const int me = c.local_rank;
  const uint64_t kept = kept_rows(*p.plan.status, p.capacity);
  const uint32_t blocks = static_cast<uint32_t>(arrival_blocks(kept));
  char* recv = reinterpret_cast<char*>(c.peer_heap_bases[me] + p.recv_offset);
  const RecvRow* origins = p.ws.at<RecvRow>(c, me, l.rows);
  // One rank: the pushing warps mark the blocks ready themselves (push_row).
  const uint32_t mine = pushers_complete_blocks(c) ? 0 : static_cast<uint32_t>(strided_share(blocks, first, stride));
  auto rows_of = [&](uint32_t f) { return block_rows(kept, f); };
  for (uint32_t base = 0; base < mine; base += kWindow) {
    const uint32_t n = min(kWindow, mine - base);
    uint32_t pending = n == 32 ? 0xffffffffu : (1u << n) - 1;  // thread 0's: the window's blocks not yet taken
    auto block_of = [&](uint32_t i) { return first + (base + i) * stride; };
    for (uint32_t left = n; left > 0; --left) {
      if (threadIdx.x == 0) {
        const uint32_t lowest = static_cast<uint32_t>(__ffs(static_cast<int>(pending)) - 1);
        uint32_t chosen = lowest;
        const bool ok = wait_until(
            p.ws.at<uint64_t>(c, me, l.arrival, block_of(lowest)),
            [&](uint64_t seen) {
              if (seen >= rows_of(block_of(lowest))) return true;
              for (uint32_t m = pending & (pending - 1); m != 0; m &= m - 1) {
                const uint32_t i = static_cast<uint32_t>(__ffs(static_cast<int>(m)) - 1);
                if (flag_load_acquire(p.ws.at<uint64_t>(c, me, l.arrival, block_of(i))) >= rows_of(block_of(i))) {
                  chosen = i;
                  return true;
                }
              }
              return false;
            },
            ctx, -1, kArrivalFlag, block_of(lowest));
        pending &= ~(1u << chosen);
        *pick = ok ? chosen : kFailed;
      }
      __syncthreads();
      const uint32_t i = *pick;
      if (i == kFailed) return false;
      const uint32_t f = block_of(i);
      const uint64_t row0 = static_cast<uint64_t>(f) * MoeTunables::kArrivalRows;
      // Repeated tokens: rows whose primary is another row of this rank.
      for (uint64_t r = row0 + warp_id(); r < row0 + rows_of(f); r += blockDim.x / 32) {
        const int32_t primary = __ldcg(&origins[r].primary);
        // primary == r: the row itself crossed NVLink; primary < r: a copy (a primary is never later)
        if (primary >= 0 && static_cast<uint64_t>(primary) < r) {
          vector_copy<MoeTunables::kCopyUnroll>(recv + r * p.row_bytes, recv + static_cast<uint64_t>(primary) * p.row_bytes,
                                                p.row_bytes, lane_id(), 32);
        }
      }
      __threadfence();
      __syncthreads();  // also: every thread has read *pick before thread 0 writes the next
      if (threadIdx.x == 0) flag_store_release(p.ws.at<uint64_t>(c, me, l.ready, f), epoch);
    }
  }
  return true;
}

}  // namespace loom::kernels::moe
