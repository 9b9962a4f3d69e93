// moe_routing: from each token's top-k expert ids and weights, on the device, the per-expert
// counts, the receive layout of every rank, the dispatch plan (each routed slot's destination
// row) and this rank's expert offsets. One persistent kernel, no host loop, no host sync.
//
// One launch on rank `me` of W = N x L with epoch e (docs/MOE.md "Routing" has the picture):
//   1. count (every CTA): warp g ranks the (token, slot) pairs of chunk g (kChunkTokens tokens)
//      in (token, slot) order: each pair's rank among the chunk's earlier pairs of its expert
//      (a stable counting sort: the match of equal ids within 32 pairs, then a running histogram
//      per warp in shared memory). Ranks go to slot_dest, the histogram to chunk_counts[g]; on
//      several nodes each token's destination nodes go to token_nodes and are counted per node;
//      then chunk_flags[g] = e. Ids outside [0, E) other than -1 are recorded (smallest pair).
//   2. coordinate (the coordinator CTA, after its own chunks): waits for every chunk; turns
//      chunk_counts into per-expert exclusive prefixes over the chunks (so a pair's rank among
//      ALL of this rank's pairs of its expert is prefix + chunk rank); sends its row (a header
//      with its first bad id, its tokens per node, then its E counts) into every local rank's
//      count_table[me], then count_flags[me] = e there (each rank's entry first). Across nodes
//      the row crosses the network once per node, to this rank's same-index GPU there (network
//      entry first; flag: launch word remote_slot(that node, mine)), which forwards it over
//      NVLink to its local ranks exactly like its own row; this rank forwards the rows of its
//      same-index GPUs likewise. Then it waits for every rank's row. From the
//      full W x E table every rank derives the same facts: whether any rank had a bad id, each
//      rank's received rows, and so whether MoeOverflow::kError fails the call; the receive layout
//      of every rank (expert-major, then source rank: expert e's rows from rank s start at
//      base(e) + rows of e from ranks below s); send_base[e], where this rank's rows of expert e
//      start on the rank holding e; and its own expert_offsets. The status words go to the plan,
//      then routing_words[layout] = e.
//   3. place (every CTA): waits for the layout, then rewrites its chunks' slots as destinations:
//      slot_dest = d * C + (send_base[e] + prefix + rank), or -1 when unused, past the capacity
//      (kDrop: counted in dropped_slots) or when the call failed.
// Every wait is bounded (wait_flag); all CTAs are resident (grid <= SMs), so waits inside the
// launch only need the other CTAs to run, and the waits for peers only need their flags. The
// count row is this rank's network source: the coordinator waits for the proxy to have sent it
// before the launch ends (the next routing zeroes the table).
#pragma once

#include <cstdint>

#include "kernels/comm/entry.cuh"
#include "kernels/comm/net.cuh"
#include "kernels/comm/signals.cuh"
#include "kernels/comm/wait.cuh"
#include "kernels/frame/persistent.cuh"
#include "kernels/frame/role_table.h"
#include "kernels/moe/common.cuh"
#include "kernels/moe/flags.h"
#include "kernels/moe/layout.h"

namespace loom::kernels::moe {

enum class RoutingRole : uint32_t {
  kCoordinator = 0,  // one CTA: counts its chunks, then scans, exchanges the counts, lays out
  kCount = 1,        // the rest: count and place their chunks
};
using RoutingRoleTable = frame::RoleTable<RoutingRole, RoutingRole::kCount>;

struct RoutingParams : LaunchCommon {
  const int32_t* ids;        // [T, k] device
  const float* weights;      // [T, k] device, or null (weights 1)
  int32_t* expert_offsets;   // [El + 1]
  MoeStatusWords* status;    // plan regions (PlanLayout)
  int32_t* slot_dest;        // [T * k]
  float* slot_weight;        // [T * k]
  int32_t* chunk_counts;     // [chunks][E]
  int32_t* send_base;        // [E]
  uint64_t* token_nodes;     // [T] (several nodes; null on one)
  uint32_t num_tokens;       // T
  uint32_t top_k;            // k
  uint32_t num_experts;      // E
  uint32_t local_experts;    // El
  uint32_t capacity;         // C
  uint32_t drop;             // 1: MoeOverflow::kDrop
  uint32_t signature;
  uint32_t net_flag_base;    // the network window's first per-launch word (several nodes)
  RoutingRoleTable roles;
};
static_assert(sizeof(RoutingParams) <= 4096, "moe_routing's parameters must fit the classic 4 KiB limit");

// The coordinator's view of the dynamic shared memory once the chunks are counted (the counting
// warps' histograms are dead then).
struct CoordinatorSmem {
  int32_t* totals;     // [E] this rank's pairs per expert
  int64_t* colsum;     // [E] pairs of expert e from every rank; then the expert's first row on its rank
  int64_t* below;      // [E] pairs of expert e from the ranks below this one
  int64_t* rank_rows;  // [kMaxWorld] rows routed to each rank
  int32_t* words;      // [8] the header of this rank's row (4), then the call's MoeError

  static constexpr uint64_t bytes_for(uint32_t experts) {
    return align_up(4ull * experts, 8) + 16ull * experts + 8ull * MoeTunables::kMaxWorld + 32;
  }
  __device__ static CoordinatorSmem carve(uint8_t* smem, uint32_t experts) {
    CoordinatorSmem s;
    s.totals = reinterpret_cast<int32_t*>(smem);
    s.colsum = reinterpret_cast<int64_t*>(smem + align_up(4ull * experts, 8));
    s.below = s.colsum + experts;
    s.rank_rows = s.below + experts;
    s.words = reinterpret_cast<int32_t*>(s.rank_rows + MoeTunables::kMaxWorld);
    return s;
  }
};

// Dynamic shared memory of the routing kernel: the counting warps' histograms, or the
// coordinator's arrays, whichever is larger.
constexpr uint32_t routing_smem_bytes(uint32_t experts) {
  const uint64_t hist = 4ull * MoeTunables::kWarps * experts;
  const uint64_t coord = CoordinatorSmem::bytes_for(experts);
  return static_cast<uint32_t>(hist > coord ? hist : coord);
}

// Pairs [first, end) of chunk `chunk` (pair q = token * k + slot).
struct ChunkPairs {
  uint64_t first, end;
  __device__ ChunkPairs(const RoutingParams& p, uint32_t chunk) {
    const uint64_t t0 = static_cast<uint64_t>(chunk) * MoeTunables::kChunkTokens;
    const uint64_t t1 = min(static_cast<uint64_t>(p.num_tokens), t0 + MoeTunables::kChunkTokens);
    first = t0 * p.top_k;
    end = t1 * p.top_k;
  }
};

// Step 1, one warp: ranks chunk `chunk`'s pairs (slot_dest = rank among the chunk's earlier pairs
// of the same expert, or -1), copies the weights, publishes the histogram.
__device__ __forceinline__ void count_chunk(const RoutingParams& p, uint32_t chunk, int32_t* hist,
                                            unsigned long long* first_bad, uint64_t* flag, uint64_t epoch) {
  const uint32_t lane = lane_id();
  const uint32_t experts = p.num_experts;
  for (uint32_t e = lane; e < experts; e += 32) hist[e] = 0;
  __syncwarp();
  const ChunkPairs pairs(p, chunk);
  for (uint64_t base = pairs.first; base < pairs.end; base += 32) {
    const uint64_t q = base + lane;
    const bool live = q < pairs.end;
    const int32_t e = live ? p.ids[q] : kNoSlot;
    const bool routed = live && e >= 0 && static_cast<uint32_t>(e) < experts;
    if (live && !routed && e != kNoSlot) atomicMax(first_bad, ~static_cast<unsigned long long>(q));
    const uint32_t routed_lanes = __ballot_sync(0xffffffffu, routed);
    int32_t rank = kNoSlot;
    uint32_t same = 0, before = 0;
    if (routed) {
      same = __match_any_sync(routed_lanes, e);
      before = __popc(same & lanes_below());
      rank = hist[e] + static_cast<int32_t>(before);
    }
    __syncwarp();  // every lane has read its expert's count before the last of each group adds
    if (routed && before + 1 == static_cast<uint32_t>(__popc(same))) hist[e] += __popc(same);
    __syncwarp();
    if (live) {
      p.slot_dest[q] = rank;
      p.slot_weight[q] = p.weights != nullptr ? p.weights[q] : 1.0f;
    }
  }
  int32_t* out = p.chunk_counts + static_cast<uint64_t>(chunk) * experts;
  for (uint32_t e = lane; e < experts; e += 32) out[e] = hist[e];
  if (p.token_nodes != nullptr) {
    // Several nodes: each token's destination nodes (a lane per token), counted per node.
    const JobRanks r(p.comm);
    int32_t* node_tokens = p.ws.at<int32_t>(p.comm, p.comm.local_rank, p.ws.layout.node_tokens);
    const uint64_t t1 = pairs.end / p.top_k;
    for (uint64_t t = pairs.first / p.top_k + lane; t < t1; t += 32) {
      uint64_t nodes = 0;
      for (uint32_t j = 0; j < p.top_k; ++j) {
        const int32_t e = p.ids[t * p.top_k + j];
        if (e >= 0 && static_cast<uint32_t>(e) < experts) nodes |= 1ull << r.node_of(static_cast<uint32_t>(e) / p.local_experts);
      }
      p.token_nodes[t] = nodes;
      for (uint64_t m = nodes; m != 0; m &= m - 1) atomicAdd(node_tokens + __ffsll(static_cast<long long>(m)) - 1, 1);
    }
  }
  __threadfence();
  __syncwarp();
  if (lane == 0) flag_store_release(flag, epoch);
}

// Step 2's exchange across nodes (the coordinator CTA, all threads; N > 1): this rank's row, already
// in its own count table, to its same-index GPU on every other node (thread i: remote slot i, its
// own proxy lane), then the rows of those GPUs, as they arrive, to every local rank. `entered`:
// the local ranks' entries are already waited for. False after a failed wait (recorded).
__device__ __forceinline__ bool exchange_across_nodes(const RoutingParams& p, const frame::LaunchFrame& f,
                                                      uint32_t row_ints) {
  const DeviceComm& c = p.comm;
  const WorkspaceLayout& l = p.ws.layout;
  const JobRanks r(c);
  const uint32_t tid = threadIdx.x;
  const uint32_t remote = r.nodes - 1;
  const uint64_t row_bytes = 4ull * row_ints;
  const uint64_t my_row = p.ws.offset + l.count_table + r.position() * row_bytes;
  bool ok = true;
  if (tid < remote) {
    const uint32_t n = remote_node(r.node, tid, r.nodes);
    ok = wait_network_entry(c, static_cast<int>(n), p.signature, f.ctx) &&
         net_put(c, tid, net_rank_of(c, static_cast<int>(n), c.local_rank), my_row, my_row, row_bytes,
                 p.net_flag_base + remote_slot(n, r.node, r.nodes), f.ctx);
  }
  if (!cta_all(ok)) return false;
  __shared__ int arrived;
  for (uint32_t i = 0; i < remote; ++i) {
    const uint32_t from = remote_node(r.node, i, r.nodes);
    const uint32_t source = r.peer_on(from);
    if (tid == 0) arrived = net_wait(c, p.net_flag_base + i, net_rank_of(c, static_cast<int>(from), c.local_rank), f.ctx) ? 1 : 0;
    __syncthreads();
    if (arrived == 0) return false;
    const int32_t* row = p.ws.at<int32_t>(c, c.local_rank, l.count_table, static_cast<uint64_t>(source) * row_ints);
    for (uint32_t k = tid; k < r.local * row_ints; k += blockDim.x) {
      const uint32_t d = k / row_ints;
      if (d != r.me) *p.ws.at<int32_t>(c, static_cast<int>(d), l.count_table, static_cast<uint64_t>(source) * row_ints + k % row_ints) = row[k % row_ints];
    }
    __threadfence_system();
    __syncthreads();
    if (tid < r.local) flag_store_release(p.ws.at<uint64_t>(c, static_cast<int>(tid), l.count_flags, source), f.epoch);
  }
  return true;
}

// Step 2, the coordinator CTA (all threads). False after a failed wait (recorded).
__device__ __forceinline__ bool coordinate(const RoutingParams& p, const frame::LaunchFrame& f, uint8_t* smem,
                                           uint32_t chunks) {
  const DeviceComm& c = p.comm;
  const WorkspaceLayout& l = p.ws.layout;
  const JobRanks r(c);
  const uint32_t tid = threadIdx.x;
  const uint32_t experts = p.num_experts;
  const uint32_t per_rank = p.local_experts;
  const uint32_t world = r.world();
  const uint32_t me = r.position();
  const uint32_t local_me = r.me;
  const uint64_t epoch = f.epoch;
  const bool net = r.nodes > 1;

  // The network peers learn that this rank entered (they send their count rows only after).
  bool ok = true;
  if (net && tid == 0) ok = announce_network_entry(c, EntryPeers::kAll, p.signature, f.ctx);
  // Every chunk of this rank is counted.
  for (uint32_t g = tid; g < chunks && ok; g += blockDim.x) {
    ok = wait_flag(p.ws.at<uint64_t>(c, c.local_rank, l.chunk_flags, g), epoch, f.ctx, -1, kChunkFlag, g);
  }
  if (!cta_all(ok)) return false;

  // Per expert: exclusive prefix over the chunks (in place) and this rank's total.
  const CoordinatorSmem s = CoordinatorSmem::carve(smem, experts);
  for (uint32_t e = tid; e < experts; e += blockDim.x) {
    int32_t run = 0;
    for (uint32_t g = 0; g < chunks; ++g) {
      int32_t* at = p.chunk_counts + static_cast<uint64_t>(g) * experts + e;
      const int32_t v = *at;
      *at = run;
      run += v;
    }
    s.totals[e] = run;
  }
  if (tid == 0) {
    // This rank's header: its first bad id (the smallest pair), if any.
    const unsigned long long bad = *p.ws.at<unsigned long long>(c, c.local_rank, l.routing_words, kFirstBadWord);
    const uint64_t q = ~static_cast<uint64_t>(bad);
    s.words[0] = bad != 0 ? static_cast<int32_t>(MoeError::kBadExpert) : 0;
    s.words[1] = bad != 0 ? static_cast<int32_t>(q / p.top_k) : 0;
    s.words[2] = bad != 0 ? static_cast<int32_t>(q % p.top_k) : 0;
    s.words[3] = bad != 0 ? p.ids[q] : 0;
  }
  __syncthreads();

  // This rank's row into every local rank's count table (each rank's entry first), then its flag.
  ok = tid >= r.local || tid == local_me || wait_entry(c, moe_entry(c), static_cast<int>(tid), epoch, p.signature, f.ctx);
  if (!cta_all(ok)) return false;
  const uint32_t row_ints = count_row_ints(experts, r.nodes);
  const int32_t* node_tokens = p.ws.at<int32_t>(c, c.local_rank, l.node_tokens);
  for (uint32_t i = tid; i < r.local * row_ints; i += blockDim.x) {
    const uint32_t d = i / row_ints;
    const uint32_t w = i - d * row_ints;
    int32_t v = 0;
    if (w < kCountHeaderInts) {
      v = s.words[w];
    } else if (w < count_expert_word(r.nodes, 0)) {
      v = net ? node_tokens[w - kCountHeaderInts] : 0;
    } else if (w - count_expert_word(r.nodes, 0) < experts) {
      v = s.totals[w - count_expert_word(r.nodes, 0)];
    }
    *p.ws.at<int32_t>(c, static_cast<int>(d), l.count_table, static_cast<uint64_t>(me) * row_ints + w) = v;
  }
  __threadfence_system();
  __syncthreads();
  if (tid < r.local) flag_store_release(p.ws.at<uint64_t>(c, static_cast<int>(tid), l.count_flags, me), epoch);
  if (net && !exchange_across_nodes(p, f, row_ints)) return false;

  // Every rank's row.
  ok = true;
  for (uint32_t src = tid; src < world && ok; src += blockDim.x) {
    // Named by its local index when on this node (a row from another node is waited for first
    // on the network, naming its sender's rank).
    const int writer = r.node_of(src) == r.node ? static_cast<int>(r.local_of(src)) : -1;
    ok = wait_flag(p.ws.at<uint64_t>(c, c.local_rank, l.count_flags, src), epoch, f.ctx, writer, kCountsFlag, src);
  }
  if (!cta_all(ok)) return false;
  const int32_t* table = p.ws.at<int32_t>(c, c.local_rank, l.count_table);
  auto count = [&](uint32_t source, uint32_t e) {
    return table[static_cast<uint64_t>(source) * row_ints + count_expert_word(r.nodes, e)];
  };

  // Rows routed to each rank, then the call's verdict and this rank's status words.
  for (uint32_t d = tid; d < world; d += blockDim.x) {
    int64_t rows = 0;
    for (uint32_t src = 0; src < world; ++src) {
      for (uint32_t i = 0; i < per_rank; ++i) rows += count(src, d * per_rank + i);
    }
    s.rank_rows[d] = rows;
  }
  __syncthreads();
  if (tid == 0) {
    MoeStatusWords st{};
    int64_t most = 0;
    for (uint32_t d = 0; d < world; ++d) most = max(most, s.rank_rows[d]);
    for (uint32_t src = 0; src < world && st.code == 0; ++src) {
      const int32_t* header = table + static_cast<uint64_t>(src) * row_ints;
      if (header[0] != 0) {
        st.code = header[0];
        st.rank = static_cast<int32_t>(src);
        st.token = header[1];
        st.slot = header[2];
        st.value = header[3];
      }
    }
    for (uint32_t d = 0; d < world && st.code == 0 && p.drop == 0; ++d) {
      if (s.rank_rows[d] > static_cast<int64_t>(p.capacity)) {
        st.code = static_cast<int32_t>(MoeError::kCapacity);
        st.rank = static_cast<int32_t>(d);
        st.token = s.rank_rows[d];
      }
    }
    st.recv_rows = s.rank_rows[me];
    st.kept_rows = st.code != 0 ? 0 : min(st.recv_rows, static_cast<int64_t>(p.capacity));
    st.dropped_rows = st.code != 0 ? 0 : st.recv_rows - st.kept_rows;
    st.dropped_slots = 0;
    st.max_recv_rows = most;
    st.num_tokens = p.num_tokens;
    st.epoch = epoch;
    *p.status = st;
    s.words[4] = st.code;
  }
  __syncthreads();
  const bool failed = s.words[4] != 0;

  // The receive layout: expert-major, then source rank. send_base[e]: where this rank's rows of
  // expert e start on the rank holding it; expert_offsets: this rank's experts' first rows.
  if (!failed) {
    for (uint32_t e = tid; e < experts; e += blockDim.x) {
      int64_t all = 0, below = 0;
      for (uint32_t src = 0; src < world; ++src) {
        const int32_t v = count(src, e);
        all += v;
        if (src < me) below += v;
      }
      s.colsum[e] = all;
      s.below[e] = below;
    }
    __syncthreads();
    for (uint32_t d = tid; d < world; d += blockDim.x) {
      int64_t run = 0;
      for (uint32_t i = 0; i < per_rank; ++i) {
        const int64_t v = s.colsum[d * per_rank + i];
        s.colsum[d * per_rank + i] = run;
        run += v;
      }
    }
    __syncthreads();
    const int64_t cap = p.capacity;
    for (uint32_t e = tid; e < experts; e += blockDim.x) {
      p.send_base[e] = static_cast<int32_t>(min(cap, s.colsum[e] + s.below[e]));
    }
    for (uint32_t i = tid; i <= per_rank; i += blockDim.x) {
      const int64_t first = i < per_rank ? s.colsum[me * per_rank + i] : s.rank_rows[me];
      p.expert_offsets[i] = static_cast<int32_t>(min(cap, first));
    }
  } else {
    for (uint32_t i = tid; i <= per_rank; i += blockDim.x) p.expert_offsets[i] = 0;
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) flag_store_release(p.ws.at<uint64_t>(c, c.local_rank, l.routing_words, kLayoutReadyWord), epoch);
  // The count row is the network source of this launch: sent before the launch ends.
  ok = !net || tid != 0 || net_wait_proxy_done(c, f.ctx);
  return cta_all(ok);
}

// Step 3, one warp: the chunk's ranks become destinations; returns the slots dropped for lack of
// room (kDrop).
__device__ __forceinline__ uint32_t place_chunk(const RoutingParams& p, uint32_t chunk, bool failed) {
  const uint32_t lane = lane_id();
  const ChunkPairs pairs(p, chunk);
  const int32_t* prefix = p.chunk_counts + static_cast<uint64_t>(chunk) * p.num_experts;
  uint32_t dropped = 0;
  for (uint64_t base = pairs.first; base < pairs.end; base += 32) {
    const uint64_t q = base + lane;
    bool lost = false;
    if (q < pairs.end) {
      const int32_t rank = p.slot_dest[q];
      int32_t dest = kNoSlot;
      if (rank != kNoSlot && !failed) {
        const int32_t e = p.ids[q];
        const int64_t row = static_cast<int64_t>(p.send_base[e]) + prefix[e] + rank;
        const uint32_t owner = static_cast<uint32_t>(e) / p.local_experts;
        if (row < static_cast<int64_t>(p.capacity)) {
          dest = static_cast<int32_t>(owner * p.capacity + static_cast<uint32_t>(row));
        } else {
          lost = true;
        }
      }
      p.slot_dest[q] = dest;
    }
    dropped += __popc(__ballot_sync(0xffffffffu, lost));
  }
  return dropped;
}

__global__ void __launch_bounds__(MoeTunables::kThreads, 1) moe_routing_kernel(const __grid_constant__ RoutingParams p) {
  extern __shared__ __align__(16) uint8_t smem[];
  const DeviceComm& c = p.comm;
  const WorkspaceLayout& l = p.ws.layout;
  const frame::LaunchFrame f = frame::LaunchFrame::enter(c, kRoutingOp, moe_entry(c), p.signature);
  const int me = c.local_rank;  // this GPU's own workspace
  const uint32_t chunks = static_cast<uint32_t>(routing_chunks(p.num_tokens));
  const uint32_t warps = gridDim.x * MoeTunables::kWarps;
  const uint32_t my_warp = blockIdx.x * MoeTunables::kWarps + warp_id();

  int32_t* hist = reinterpret_cast<int32_t*>(smem) + warp_id() * p.num_experts;
  auto* first_bad = p.ws.at<unsigned long long>(c, me, l.routing_words, kFirstBadWord);
  for (uint32_t g = my_warp; g < chunks; g += warps) {
    count_chunk(p, g, hist, first_bad, p.ws.at<uint64_t>(c, me, l.chunk_flags, g), f.epoch);
  }
  __syncthreads();  // the histograms are dead: the coordinator reuses the shared memory

  bool ok = true;
  if (p.roles.role_of(blockIdx.x) == RoutingRole::kCoordinator) ok = coordinate(p, f, smem, chunks);
  __shared__ int failed_shared;
  if (ok) {
    bool ready = true;
    if (threadIdx.x == 0) {
      ready = wait_flag(p.ws.at<uint64_t>(c, me, l.routing_words, kLayoutReadyWord), f.epoch, f.ctx, -1, kLayoutFlag, 0);
      failed_shared = ready ? p.status->code : 0;
    }
    ok = cta_all(ready);
  }
  if (ok) {
    const bool failed = failed_shared != 0;
    uint32_t dropped = 0;
    for (uint32_t g = my_warp; g < chunks; g += warps) dropped += place_chunk(p, g, failed);
    if (lane_id() == 0 && dropped != 0) {
      atomicAdd(reinterpret_cast<unsigned long long*>(&p.status->dropped_slots), static_cast<unsigned long long>(dropped));
    }
  }
  f.finish(p.state, c);
}

}  // namespace loom::kernels::moe
