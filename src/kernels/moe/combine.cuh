// moe_combine: each token's weighted sum of its expert outputs, back at the token's owner:
//   out[t] = sum over routed slots j = 0, 1, ..., k-1 (in that order) of w[t, j] * y[row(t, j)]
// in fp32 (fused multiply-adds, one rounding to the output type at the end), where y is the
// expert output buffer (symmetric, rows in the receive layout) and row(t, j) the slot's row on
// the rank holding its expert (the routing's slot_dest). The order is fixed, so every run is
// bit-identical; a token without routed slots gets zeros.
//
// The owner pulls: warp w takes tokens w, w + warps, ... and reads each slot's row over NVLink
// (16-byte loads that bypass L1) after that rank's entry word of this launch (its expert outputs
// are complete: its stream reached the combine). Roles (CombineRoleTable): the finisher and the
// reducers reduce; the finisher then waits (bounded) for every CTA's read_done flag, tells every
// local rank it is done reading its outputs (done[me] = e there, after its entry), and waits for
// every local rank's done[]: a rank's launch ends only once nobody reads its outputs any more, so
// its stream may overwrite them next. When the routing failed nothing is read or written (the
// handshake still runs).
//
// Several nodes: the order becomes "per node, its slots in slot order; then the node sums in node
// order" (one node: the same as above). The owner's reducers sum the slots on their own node; the
// forward CTAs of every rank sum, for each token entry its same-index GPUs on other nodes staged
// here in the plan's dispatch, the entry's slots on this node into an fp32 partial row of the
// return window, and hand it back by chunk through the proxy (net_window.cuh) into the owner's
// `partials`; the owner waits for each remote node's chunk (token_pos says where its row is) and
// adds the node sums in node order. The forward CTAs read local ranks' outputs too, so they count
// in read_done like the reducers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/comm/copy.cuh"
#include "kernels/comm/entry.cuh"
#include "kernels/comm/signals.cuh"
#include "kernels/comm/vector_math.cuh"
#include "kernels/comm/wait.cuh"
#include "kernels/frame/persistent.cuh"
#include "kernels/frame/role_table.h"
#include "kernels/moe/common.cuh"
#include "kernels/moe/dispatch.cuh"  // tokens_to_node
#include "kernels/moe/flags.h"
#include "kernels/moe/layout.h"
#include "kernels/moe/net_window.cuh"

namespace loom::kernels::moe {

enum class CombineRole : uint32_t {
  kFinisher = 0,  // one CTA: reduces its tokens, then the done handshake with every local rank
  kForward = 1,   // several nodes: the partial sums of the tokens other nodes staged here, sent back
  kReduce = 2,    // the rest: reduce their tokens
};
using CombineRoleTable = frame::RoleTable<CombineRole, CombineRole::kReduce>;

struct CombineParams : LaunchCommon {
  PlanView plan;                 // the routing's
  const uint64_t* token_nodes;   // [T] the routing's (several nodes; null on one)
  const float* weights;          // [T * k]: the caller's, or the routing's copy (plan.slot_weight)
  uint64_t y_offset;             // heap offset of the expert outputs [C, H']
  uint64_t row_bytes;            // H' * element size (a multiple of 16)
  char* out;                     // [T, H'] local
  const char* addend;            // [T, H'] local rows added to the token sums in fp32 last (moe_layer's
                                 // shared expert); null: none
  uint32_t num_tokens;
  uint32_t top_k;
  uint32_t capacity;
  uint32_t max_tokens;           // Tmax (the network windows' entries)
  uint32_t num_experts;          // E
  uint32_t signature;
  uint32_t net_flag_base;        // the network window's first per-launch word (several nodes)
  CombineRoleTable roles;
};
static_assert(sizeof(CombineParams) <= 4096, "moe_combine's parameters must fit the classic 4 KiB limit");

// One warp: waits (bounded, once per warp and rank) for the entry of every local rank that holds
// one of the lanes' rows (`here`, `owner` its rank of the job). False after a failed wait.
__device__ __forceinline__ bool enter_owners(const CombineParams& p, const JobRanks& r, bool here, uint32_t owner,
                                             uint32_t& entered, uint64_t epoch, const WaitContext& ctx) {
  const uint32_t lane = lane_id();
  const uint32_t d_local = r.local_of(owner);
  uint32_t unseen = __ballot_sync(0xffffffffu, here && (entered & (1u << d_local)) == 0);
  while (unseen != 0) {
    const uint32_t d = __shfl_sync(0xffffffffu, d_local, __ffs(unseen) - 1);
    bool ok = true;
    if (lane == 0) ok = wait_entry(p.comm, moe_entry(p.comm), static_cast<int>(d), epoch, p.signature, ctx);
    if (!__shfl_sync(0xffffffffu, ok, 0)) return false;
    entered |= 1u << d;
    unseen &= ~__ballot_sync(0xffffffffu, here && d_local == d);
    __syncwarp();  // the warp's loads from d are ordered after lane 0's acquire of its entry
  }
  return true;
}

// How a reducing warp knows that the rows it is about to read are final: a Gate policy's
//   bool admit(const CombineParams&, const JobRanks&, bool here, uint32_t owner, uint32_t row,
//              uint32_t& entered, uint64_t epoch, const WaitContext&) const;
// called by all lanes of the warp, lane j for slot j (`here`: its row is on this node, at `row` of
// local rank `owner`'s expert outputs); true once every such row may be read, false after a failed
// wait (recorded). moe_combine's EntryGate waits for each owner's entry word (the owner's stream
// reached the combine, so its outputs are complete); moe_layer's gate waits per row
// (kernels/moe/layer.cuh). With an addend (CombineParams::addend), also
//   bool admit_addend(const CombineParams&, uint32_t token, uint64_t epoch, const WaitContext&) const;
// (all lanes) says when the token's addend row may be read.
struct EntryGate {
  __device__ bool admit_addend(const CombineParams&, uint32_t, uint64_t, const WaitContext&) const {
    return true;  // moe_combine passes no addend
  }
  __device__ bool admit(const CombineParams& p, const JobRanks& r, bool here, uint32_t owner, uint32_t /*row*/,
                        uint32_t& entered, uint64_t epoch, const WaitContext& ctx) const {
    return enter_owners(p, r, here, owner, entered, epoch, ctx);
  }
};

// The reducing warps' sum shape (MoeTunables::kCombineSum).
inline constexpr SumShape kSumShape = MoeTunables::kCombineSum;

// One warp, vectors v + 32 i (i < kSumShape.vectors) of a row, all lanes (a lane's vector exists when
// it is below `vectors`): the fp32 sum in slot order of w_j * y_j over the lanes' row addresses (0:
// no row), into acc[i]. The slots are taken kSumShape.slots at a time, the loads of all of a batch's
// slots and vectors issued before the fused multiply-adds; the adds keep slot order, so the bits
// do not depend on the shape. `local_slots` (bit j: slot j's row is on this GPU, warp-uniform):
// those rows' vectors kSumShape.ahead passes on are prefetched into L2 (rows already final: the
// caller's gate admitted them).
template <typename T>
__device__ __forceinline__ void sum_slots(float (&acc)[kSumShape.vectors][Vec16<T>::kElems], uint64_t row_addr, float w,
                                          uint32_t k, uint64_t v, uint64_t vectors, uint32_t local_slots) {
  using V = Vec16<T>;
  constexpr int kSumVectors = kSumShape.vectors;
  constexpr uint32_t kSlotBatch = kSumShape.slots;
#pragma unroll
  for (int i = 0; i < kSumVectors; ++i) {
#pragma unroll
    for (int e = 0; e < V::kElems; ++e) acc[i][e] = 0.0f;
  }
  for (uint32_t j0 = 0; j0 < k; j0 += kSlotBatch) {
    uint4 raw[kSlotBatch][kSumVectors];
    float wj[kSlotBatch];
    bool routed[kSlotBatch];
#pragma unroll
    for (uint32_t u = 0; u < kSlotBatch; ++u) {
      const uint32_t j = j0 + u;  // < kMaxTopK: lanes at or past k hold no row
      const uint64_t addr = __shfl_sync(0xffffffffu, row_addr, j);
      wj[u] = __shfl_sync(0xffffffffu, w, j);
      routed[u] = addr != 0;  // slot j is routed here (warp-uniform)
      if constexpr (kSumShape.ahead > 0) {
        if (((local_slots >> j) & 1u) != 0) {
#pragma unroll
          for (int i = 0; i < kSumVectors; ++i) {
            const uint64_t later = v + 32 * static_cast<uint64_t>(i + kSumVectors * kSumShape.ahead);
            if (later < vectors) prefetch_l2(reinterpret_cast<const uint4*>(addr) + later);
          }
        }
      }
#pragma unroll
      for (int i = 0; i < kSumVectors; ++i) {
        const uint64_t vi = v + 32 * static_cast<uint64_t>(i);
        raw[u][i] = routed[u] && vi < vectors ? load_peer_vector(reinterpret_cast<const uint4*>(addr) + vi)
                                              : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (uint32_t u = 0; u < kSlotBatch; ++u) {
      if (!routed[u]) continue;
#pragma unroll
      for (int i = 0; i < kSumVectors; ++i) {
        float y[V::kElems];
#pragma unroll
        for (int e = 0; e < V::kElems; ++e) y[e] = 0.0f;
        V::add(y, raw[u][i]);  // 0 + y: exact
#pragma unroll
        for (int e = 0; e < V::kElems; ++e) acc[i][e] = __fmaf_rn(wj[u], y[e], acc[i][e]);
      }
    }
  }
}

// One warp: walks a row in passes of 32 kSumShape.vectors vectors that every lane takes part in, also
// when the row's last pass has fewer (the full-mask shuffles inside then always meet the whole
// warp; a loop bounded per lane, v = lane, lane + 32, ..., hangs the warp whenever the vector
// count is not a multiple of 32: the lanes with one more vector shuffle alone). For each of a
// lane's vectors v of a pass: use(v, live, acc), acc its slot-order sum (sum_slots), live when the
// row has vector v; every lane calls it, so it may shuffle too.
template <typename T, class Use>
__device__ __forceinline__ void sum_row(uint64_t row_addr, float w, uint32_t k, uint64_t vectors, uint32_t local_slots,
                                        Use&& use) {
  for (uint64_t base = 0; base < vectors; base += 32 * kSumShape.vectors) {
    float acc[kSumShape.vectors][Vec16<T>::kElems];
    sum_slots<T>(acc, row_addr, w, k, base + lane_id(), vectors, local_slots);
#pragma unroll
    for (int s = 0; s < kSumShape.vectors; ++s) {
      const uint64_t v = base + lane_id() + 32 * static_cast<uint64_t>(s);
      use(v, v < vectors, acc[s]);
    }
  }
}

// One warp: tokens first, first + stride, ... of this rank. A token's slots on this node are
// read over NVLink; on several nodes, each other node holding one of its experts returns one
// fp32 partial (its slots' sum in slot order) into `partials`, and the node sums are added in
// node order (this node's own in its place). False after a failed wait (recorded).
template <typename T, class Gate = EntryGate>
__device__ __forceinline__ bool reduce_tokens(const CombineParams& p, uint32_t first, uint32_t stride, uint64_t epoch,
                                              const WaitContext& ctx, const Gate& gate = {}) {
  using V = Vec16<T>;
  constexpr uint32_t kChunk = MoeTunables::kNetChunkTokens;
  const DeviceComm& c = p.comm;
  const WorkspaceLayout& l = p.ws.layout;
  const JobRanks r(c);
  const uint32_t lane = lane_id();
  const uint32_t k = p.top_k;
  const uint32_t cap = p.capacity;
  const uint64_t vectors = p.row_bytes / kVectorBytes;
  const uint32_t remote = r.nodes - 1;
  uint32_t entered = 1u << c.local_rank;  // local ranks whose entry this warp has seen (lane-uniform)
  for (uint32_t t = first; t < p.num_tokens; t += stride) {
    // Lane j < k: slot j's row (its address on its rank, when on this node) and weight.
    const uint64_t q = static_cast<uint64_t>(t) * k + lane;
    const int32_t dest = lane < k ? valid_slot(p.plan.slot_dest[q], r.world(), cap) : kNoSlot;
    const uint32_t owner = dest != kNoSlot ? static_cast<uint32_t>(dest) / cap : 0;
    const bool here = dest != kNoSlot && r.node_of(owner) == r.node;
    const float w = here ? p.weights[q] : 0.0f;
    const uint32_t row = here ? static_cast<uint32_t>(dest) - owner * cap : 0;
    const uint64_t row_addr =
        here ? c.peer_heap_bases[r.local_of(owner)] + p.y_offset + static_cast<uint64_t>(row) * p.row_bytes : 0;
    if (!gate.admit(p, r, here, owner, row, entered, epoch, ctx)) return false;
    if (p.addend != nullptr && !gate.admit_addend(p, t, epoch, ctx)) return false;
    const uint32_t local_slots = __ballot_sync(0xffffffffu, here && r.local_of(owner) == static_cast<uint32_t>(c.local_rank));
    const uint4* addend = p.addend != nullptr
                              ? reinterpret_cast<const uint4*>(p.addend + static_cast<uint64_t>(t) * p.row_bytes)
                              : nullptr;
    // Several nodes: lane n < N holds node n's partial row (0: none, or this node).
    const uint64_t nodes = p.token_nodes != nullptr ? p.token_nodes[t] & ~(1ull << r.node) : 0;
    const float* partial = nullptr;
    bool arrived = true;
    if (lane < r.nodes && ((nodes >> lane) & 1) != 0) {
      const uint32_t i = remote_slot(r.node, lane, r.nodes);
      const uint32_t pos = static_cast<uint32_t>(*p.ws.at<int32_t>(c, c.local_rank, l.token_pos, static_cast<uint64_t>(t) * remote + i));
      arrived = net_wait(c, p.net_flag_base + i * l.window_chunks + pos / kChunk,
                         net_rank_of(c, static_cast<int>(lane), c.local_rank), ctx);
      partial = reinterpret_cast<const float*>(p.ws.base(c, c.local_rank) + l.partials +
                                               (static_cast<uint64_t>(i) * p.max_tokens + pos) * l.partial_bytes);
    }
    if (!__all_sync(0xffffffffu, arrived)) return false;
    uint4* out = reinterpret_cast<uint4*>(p.out + static_cast<uint64_t>(t) * p.row_bytes);
    sum_row<T>(row_addr, w, k, vectors, local_slots, [&](uint64_t v, bool live, float (&acc)[V::kElems]) {
      if (nodes != 0) {
        float total[V::kElems];
#pragma unroll
        for (int i = 0; i < V::kElems; ++i) total[i] = 0.0f;
        for (uint32_t n = 0; n < r.nodes; ++n) {
          const float* row = reinterpret_cast<const float*>(__shfl_sync(0xffffffffu, reinterpret_cast<uint64_t>(partial), n));
          if (n == r.node) {
#pragma unroll
            for (int i = 0; i < V::kElems; ++i) total[i] += acc[i];
          } else if (row != nullptr && live) {
            const float4* f4 = reinterpret_cast<const float4*>(row + v * V::kElems);
#pragma unroll
            for (int i = 0; i < V::kElems / 4; ++i) {
              const float4 x = __ldcg(f4 + i);
              total[4 * i] += x.x;
              total[4 * i + 1] += x.y;
              total[4 * i + 2] += x.z;
              total[4 * i + 3] += x.w;
            }
          }
        }
#pragma unroll
        for (int i = 0; i < V::kElems; ++i) acc[i] = total[i];
      }
      if (addend != nullptr && live) V::add(acc, __ldcg(addend + v));  // written in this launch: not from L1
      if (live) out[v] = V::pack(acc);
    });
  }
  return true;
}

// No staging flags to wait for: the entries were staged before the launch (moe_combine).
inline constexpr uint32_t kStagedBeforeLaunch = 0xffffffffu;

// One forwarding warp (several nodes): entries first, first + stride, ... of the token entries
// this rank's same-index GPUs on other nodes staged here in the dispatch of this plan: each one's
// slots on this node summed in slot order in fp32 (sum_slots), written into the return window
// toward its source and handed to the proxy by chunk (net_window_written). The Gate says when the
// slots' rows may be read (as in reduce_tokens). staged_flag_base: kStagedBeforeLaunch, or the
// dispatch's first network flag word of this launch (moe_layer: the entries arrive during it, and
// an entry's header is read only after its chunk's flag). False after a failed wait (recorded).
template <typename T, class Gate = EntryGate>
__device__ __forceinline__ bool return_partials(const CombineParams& p, uint32_t first, uint32_t stride, uint64_t epoch,
                                                const WaitContext& ctx, const Gate& gate = {},
                                                uint32_t staged_flag_base = kStagedBeforeLaunch) {
  using V = Vec16<T>;
  const DeviceComm& c = p.comm;
  const WorkspaceLayout& l = p.ws.layout;
  const JobRanks r(c);
  const uint32_t lane = lane_id();
  const uint32_t k = p.top_k;
  const uint32_t cap = p.capacity;
  const uint64_t vectors = p.row_bytes / kVectorBytes;
  uint32_t entered = 1u << c.local_rank;
  uint64_t net_entered = 0;  // lane 0's
  uint32_t entry0 = 0;       // entries of the remote slots before i
  for (uint32_t i = 0; i + 1 < r.nodes; ++i) {
    const uint32_t source_node = remote_node(r.node, i, r.nodes);
    const uint32_t source = r.peer_on(source_node);
    NetWindow win;
    win.chunk_count = p.ws.at<uint32_t>(c, c.local_rank, l.ret_count, static_cast<uint64_t>(i) * l.window_chunks);
    win.sent = p.ws.at<uint64_t>(c, c.local_rank, l.ret_sent, i);
    win.src_offset = p.ws.offset + l.ret_window + static_cast<uint64_t>(i) * p.max_tokens * l.partial_bytes;
    win.dst_offset = p.ws.offset + l.partials +
                     static_cast<uint64_t>(remote_slot(source_node, r.node, r.nodes)) * p.max_tokens * l.partial_bytes;
    win.entry_bytes = l.partial_bytes;
    win.entries = tokens_to_node(p, p.num_experts, r.nodes, source, r.node);
    win.flag_base = p.net_flag_base + remote_slot(source_node, r.node, r.nodes) * l.window_chunks;
    win.node = static_cast<int>(source_node);
    win.peer = net_rank_of(c, static_cast<int>(source_node), c.local_rank);
    const char* staged = p.ws.base(c, c.local_rank) + l.staging + static_cast<uint64_t>(i) * p.max_tokens * l.entry_bytes;
    char* ret = p.ws.base(c, c.local_rank) + l.ret_window + static_cast<uint64_t>(i) * p.max_tokens * l.partial_bytes;
    const uint32_t start = first >= entry0 ? first : entry0 + (stride - (entry0 - first) % stride) % stride;
    uint32_t arrived_chunk = ~0u;  // the last staged chunk this warp waited for (lane-uniform)
    for (uint32_t e = start; e < entry0 + win.entries; e += stride) {
      const uint32_t pos = e - entry0;
      if (staged_flag_base != kStagedBeforeLaunch && pos / MoeTunables::kNetChunkTokens != arrived_chunk) {
        arrived_chunk = pos / MoeTunables::kNetChunkTokens;
        bool ok = true;
        if (lane == 0) ok = net_wait(c, staged_flag_base + i * l.window_chunks + arrived_chunk, win.peer, ctx);
        if (!__shfl_sync(0xffffffffu, ok, 0)) return false;
        __syncwarp();  // the lanes read the entry next: ordered after lane 0's wait
      }
      const int32_t* header = reinterpret_cast<const int32_t*>(staged + static_cast<uint64_t>(pos) * l.entry_bytes);
      const int32_t dest = lane < k ? valid_slot(header[kNetHeaderFixedInts + lane], r.world(), cap) : kNoSlot;
      const uint32_t owner = dest != kNoSlot ? static_cast<uint32_t>(dest) / cap : 0;
      const bool here = dest != kNoSlot && r.node_of(owner) == r.node;
      const float w = here ? reinterpret_cast<const float*>(header)[kNetHeaderFixedInts + k + lane] : 0.0f;
      const uint64_t row_addr = here ? c.peer_heap_bases[r.local_of(owner)] + p.y_offset +
                                           static_cast<uint64_t>(static_cast<uint32_t>(dest) - owner * cap) * p.row_bytes
                                     : 0;
      if (!gate.admit(p, r, here, owner, static_cast<uint32_t>(dest) - owner * cap, entered, epoch, ctx)) return false;
      const uint32_t local_slots = __ballot_sync(0xffffffffu, here && r.local_of(owner) == static_cast<uint32_t>(c.local_rank));
      float4* out = reinterpret_cast<float4*>(ret + static_cast<uint64_t>(pos) * l.partial_bytes);
      sum_row<T>(row_addr, w, k, vectors, local_slots, [&](uint64_t v, bool live, float (&acc)[V::kElems]) {
        if (!live) return;
#pragma unroll
        for (int j = 0; j < V::kElems / 4; ++j) {
          out[v * (V::kElems / 4) + j] = make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
        }
      });
      __threadfence_system();
      __syncwarp();
      bool ok = true;
      if (lane == 0) ok = net_window_written(c, win, pos, p.signature, net_entered, ctx);
      if (!__shfl_sync(0xffffffffu, ok, 0)) return false;
    }
    entry0 += win.entries;
  }
  return true;
}

// One thread, several nodes: waits until every chunk of this rank's return windows was handed to
// the proxy and sent. False after a failed wait (recorded).
__device__ __forceinline__ bool return_windows_drained(const CombineParams& p, const WaitContext& ctx) {
  const DeviceComm& c = p.comm;
  const JobRanks r(c);
  return net_windows_drained(
      c, p.ws.at<uint64_t>(c, c.local_rank, p.ws.layout.ret_sent), r.nodes - 1,
      [&](uint32_t i) {
        return window_chunks(tokens_to_node(p, p.num_experts, r.nodes, r.peer_on(remote_node(r.node, i, r.nodes)), r.node));
      },
      kSentFlag, ctx);
}

// The forwarding role of CTA `index` of `ctas` (all threads; several nodes): CTA 0 announces this
// rank's network entry first; every CTA checks that the staged entries are this plan's
// (kMismatch otherwise: another plan's dispatch ran since), returns its partials, and CTA 0 then
// waits until every return chunk was sent. False after a failure (recorded).
template <typename T>
__device__ __forceinline__ bool forward_partials(const CombineParams& p, uint32_t index, uint32_t ctas,
                                                 const frame::LaunchFrame& f) {
  const DeviceComm& c = p.comm;
  const WorkspaceLayout& l = p.ws.layout;
  bool ok = true;
  if (threadIdx.x == 0) {
    if (index == 0) ok = announce_network_entry(c, EntryPeers::kAll, p.signature, f.ctx);
    const uint64_t staged = *p.ws.at<uint64_t>(c, c.local_rank, l.staged_epoch);
    if (ok && p.plan.status->code == 0 && staged != p.plan.status->epoch) {
      f.ctx.fail(DeviceError::kMismatch, -1, kStagedFlag, 0, staged, 0);
      ok = false;
    }
  }
  if (!cta_all(ok)) return false;
  if (p.plan.status->code == 0) {
    ok = cta_all(return_partials<T>(p, index * MoeTunables::kWarps + warp_id(), ctas * MoeTunables::kWarps, f.epoch, f.ctx));
  }
  if (ok && p.plan.status->code == 0 && index == 0 && threadIdx.x == 0) ok = return_windows_drained(p, f.ctx);
  return cta_all(ok);
}

// The finisher CTA (all threads), after its own tokens: every CTA has read, then the done
// handshake with every local rank. False after a failed wait (recorded).
__device__ __forceinline__ bool finish_reads(const CombineParams& p, uint64_t epoch, const WaitContext& ctx) {
  const DeviceComm& c = p.comm;
  const WorkspaceLayout& l = p.ws.layout;
  const int me = c.local_rank;
  const uint32_t tid = threadIdx.x;
  const uint32_t world = static_cast<uint32_t>(c.local_world);
  bool ok = true;
  for (uint32_t i = tid; i < gridDim.x && ok; i += blockDim.x) {
    ok = wait_flag(p.ws.at<uint64_t>(c, me, l.read_done, i), epoch, ctx, -1, kReadDoneFlag, i);
  }
  if (!cta_all(ok)) return false;
  if (tid < world && static_cast<int>(tid) != me) {
    ok = wait_entry(c, moe_entry(c), static_cast<int>(tid), epoch, p.signature, ctx);
    if (ok) flag_store_release(p.ws.at<uint64_t>(c, static_cast<int>(tid), l.done, me), epoch);
  }
  if (!cta_all(ok)) return false;
  if (tid < world && static_cast<int>(tid) != me) {
    ok = wait_flag(p.ws.at<uint64_t>(c, me, l.done, tid), epoch, ctx, static_cast<int>(tid), kDoneFlag, tid);
  }
  return cta_all(ok);
}

template <typename T>
__global__ void __launch_bounds__(MoeTunables::kThreads, 1) moe_combine_kernel(const __grid_constant__ CombineParams p) {
  const DeviceComm& c = p.comm;
  const frame::LaunchFrame f = frame::LaunchFrame::enter(c, kCombineOp, moe_entry(c), p.signature);
  const CombineRoleTable& roles = p.roles;
  const CombineRole role = roles.role_of(blockIdx.x);
  bool ok = true;
  if (role == CombineRole::kForward) {
    ok = forward_partials<T>(p, roles.index_in_role(blockIdx.x), roles.count(CombineRole::kForward), f);
  } else if (p.plan.status->code == 0) {
    // The finisher and the reducers share the tokens (the finisher is reducer 0).
    const uint32_t reducer = role == CombineRole::kFinisher ? 0 : 1 + roles.index_in_role(blockIdx.x);
    const uint32_t reducers = 1 + roles.count(CombineRole::kReduce, gridDim.x);
    ok = reduce_tokens<T>(p, reducer * MoeTunables::kWarps + warp_id(), reducers * MoeTunables::kWarps, f.epoch, f.ctx);
  }
  if (cta_all(ok)) {
    if (threadIdx.x == 0) flag_store_release(p.ws.at<uint64_t>(c, c.local_rank, p.ws.layout.read_done, blockIdx.x), f.epoch);
    if (role == CombineRole::kFinisher) (void)finish_reads(p, f.epoch, f.ctx);
  }
  f.mark(LaunchPhase::kRolesDone);
  f.finish(p.state, c);
}

}  // namespace loom::kernels::moe
