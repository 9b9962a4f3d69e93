// Device side of the inter-node path: network sends through the command ring, bounded waits for
// network arrival flags, and the entry handshakes of the multi-node kernels.
//
// A network send is one command pushed by ONE thread (ring_push_write): "copy [src, src + bytes)
// of my symmetric heap into rank R's heap at dst, then set word `flag` of R's network flag window
// to this launch's epoch". The proxy posts the data and then the flag, never the flag first, so
// the receiver only waits for the flag (net_wait: wait_flag on its own window, FlagKind
// kNetChunk, naming the global rank it expects the data from). Bytes the GPU itself wrote just
// before must be visible at system scope before the push: the pushing thread fences
// (__threadfence_system) after the CTA barrier that follows the writes; ring_push publishes the
// command with a release store at system scope.
//
// Entry handshake (per launch epoch e), the network twin of the NVLink one:
//   announce: one thread stores entry_word(e, signature) into its own sig_out word and sends it to
//             every network peer that will write into this rank in this launch (the 8-byte word
//             lands in the peer's net_sig[my node], the flag net_entry[my node] = e follows it);
//   wait:     before its first network write into peer P in this launch, a sender waits
//             (bounded) for net_entry[P's node] >= e in its own window: P's earlier stream work
//             is done, so its buffers are free. If P entered e with another signature, the launch
//             fails with DeviceError::kMismatch (FlagKind kNetEntry, the peer's global rank).
// Every wait is bounded (wait_flag: deadline, abort words, error record).
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/command_ring.cuh"
#include "kernels/comm/entry.cuh"
#include "kernels/comm/signals.cuh"
#include "kernels/comm/wait.cuh"
#include "runtime/command_ring.h"
#include "runtime/device_abi.h"
#include "runtime/network_layout.h"

namespace loom::kernels {

using runtime::net::NetWindowLayout;

__device__ __forceinline__ NetWindowLayout net_layout(const DeviceComm& c) {
  return NetWindowLayout{static_cast<uint32_t>(c.net.num_nodes), static_cast<uint32_t>(c.local_world)};
}

// Heap offset of word `index` of the network flag window (equal on every rank).
__device__ __forceinline__ uint64_t net_word_offset(const DeviceComm& c, uint32_t index) {
  return c.net.flag_offset + 8ull * index;
}

// Word `index` of this rank's window.
__device__ __forceinline__ uint64_t* net_word(const DeviceComm& c, uint32_t index) {
  return reinterpret_cast<uint64_t*>(c.local_heap_base + net_word_offset(c, index));
}

// Word `index` of local peer `local_rank`'s window (NVLink mapping).
__device__ __forceinline__ uint64_t* net_word_at(const DeviceComm& c, int local_rank, uint32_t index) {
  return reinterpret_cast<uint64_t*>(c.peer_heap_bases[local_rank] + net_word_offset(c, index));
}

// Where this rank sits in the job, for the families that number the job's ranks by position
// n * L + l (local index l of node n; MoE and ring attention): its node, local index and
// position, and any position's node and local index. One node: N = 1, positions are the local
// indices. The communicator's rank of a position is net_rank_of(node, local).
struct JobRanks {
  uint32_t local;  // L
  uint32_t nodes;  // N
  uint32_t node;   // this rank's node
  uint32_t me;     // this rank's local index

  __device__ explicit JobRanks(const DeviceComm& c)
      : local(static_cast<uint32_t>(c.local_world)),
        nodes(c.net.num_nodes > 1 ? static_cast<uint32_t>(c.net.num_nodes) : 1u),
        node(c.net.num_nodes > 1 ? static_cast<uint32_t>(c.net.node) : 0u),
        me(static_cast<uint32_t>(c.local_rank)) {}
  __device__ uint32_t world() const { return nodes * local; }
  __device__ uint32_t position() const { return node * local + me; }
  __device__ uint32_t node_of(uint32_t position) const { return position / local; }
  __device__ uint32_t local_of(uint32_t position) const { return position % local; }
  // The position of this rank's local index on node n (its same-index GPU there).
  __device__ uint32_t peer_on(uint32_t n) const { return n * local + me; }
};

// Global rank of the GPU with local index `local` on node `node`.
__device__ __forceinline__ int net_rank_of(const DeviceComm& c, int node, int local) {
  return c.net.rank_at[node * c.local_world + local];
}

// One thread: "copy [src_offset, +bytes) of my heap to rank dst_rank's heap at dst_offset, then
// set its flag word `flag_index` to this launch's epoch" (flag_index = ring::kNoFlag: no flag).
// Commands of one transfer go through one lane (ordering holds within a lane); callers spread
// independent chunks over lanes. False after a failed (recorded) ring-space wait.
__device__ __forceinline__ bool net_put(const DeviceComm& c, uint32_t lane, int dst_rank, uint64_t src_offset,
                                        uint64_t dst_offset, uint64_t bytes, uint32_t flag_index, const WaitContext& ctx) {
  const ring::RingView& ring = c.net.rings[lane % static_cast<uint32_t>(c.net.num_lanes)];
  return ring_push_write(ring, static_cast<uint32_t>(dst_rank), src_offset, dst_offset, bytes, flag_index, ctx.epoch, ctx);
}

// One thread: bounded wait until word `index` of this rank's window reaches this launch's epoch
// (data sent over the network by global rank `src_rank` has landed). After it, data read by TMA
// (async proxy) needs cuda::ptx::fence_proxy_async; generic loads need nothing more.
__device__ __forceinline__ bool net_wait(const DeviceComm& c, uint32_t index, int src_rank, const WaitContext& ctx) {
  return wait_flag(net_word(c, index), ctx.epoch, ctx, src_rank, FlagKind::kNetChunk, index);
}

// One thread, at the end of a launch: waits (bounded) until the proxy has completed every command
// this GPU pushed into any lane so far (RingControl::completed reaches the ring's head). Until
// then the transport may still read the launch's source buffers (send buffers, rows forwarded
// from this heap, an output sent to peers), which the next launch or the application may
// overwrite. The word is host memory: one thread polls it, with the wait's back-off.
__device__ __forceinline__ bool net_wait_proxy_done(const DeviceComm& c, const WaitContext& ctx) {
  for (int lane = 0; lane < c.net.num_lanes; ++lane) {
    const ring::RingView& ring = c.net.rings[lane];
    const uint64_t head = *reinterpret_cast<const volatile uint64_t*>(&ring.producer->head);
    if (!wait_flag(ring::ring_completed(ring), head, ctx, -1, FlagKind::kProxyDone, static_cast<uint32_t>(lane))) return false;
  }
  return true;
}

// ---- entry handshakes -----------------------------------------------------------------------

// The multi-node operators' NVLink entry words (kernels/comm/entry.cuh): the network window's
// nvl_entry[0, L).
__device__ __forceinline__ EntryWords nvlink_entry(const DeviceComm& c) {
  return {net_word_offset(c, net_layout(c).nvl_entry(0))};
}

// Which network peers write into a rank in a launch, and so must learn that it entered.
enum class EntryPeers : uint32_t {
  kAll,              // every other node's same-index GPU (direct exchanges)
  kRingPredecessor,  // node (n - 1) mod N only (ring algorithms: only the predecessor sends to us)
};

// One thread: tells the network peers that write into this rank that it entered the launch.
// Each write carries the signature word (data), then net_entry[my node] = epoch.
__device__ __forceinline__ bool announce_network_entry(const DeviceComm& c, EntryPeers peers, uint32_t signature,
                                                          const WaitContext& ctx) {
  const NetWindowLayout layout = net_layout(c);
  uint64_t* out = net_word(c, layout.sig_out());
  *reinterpret_cast<volatile uint64_t*>(out) = entry_word(ctx.epoch, signature);
  __threadfence_system();  // the proxy's transport reads the word from this heap
  const uint32_t me = static_cast<uint32_t>(c.net.node);
  const int predecessor = (c.net.node + c.net.num_nodes - 1) % c.net.num_nodes;
  for (int n = 0; n < c.net.num_nodes; ++n) {
    if (n == c.net.node || (peers == EntryPeers::kRingPredecessor && n != predecessor)) continue;
    if (!net_put(c, 0, net_rank_of(c, n, c.local_rank), net_word_offset(c, layout.sig_out()),
                 net_word_offset(c, layout.net_sig(me)), sizeof(uint64_t), layout.net_entry(me), ctx)) {
      return false;
    }
  }
  return true;
}

// One thread: has the same-index GPU of node `node` entered this launch with the same plan?
// Bounded; call before the first network write into it.
__device__ __forceinline__ bool wait_network_entry(const DeviceComm& c, int node, uint32_t signature,
                                                      const WaitContext& ctx) {
  const NetWindowLayout layout = net_layout(c);
  const int rank = net_rank_of(c, node, c.local_rank);
  if (!wait_flag(net_word(c, layout.net_entry(static_cast<uint32_t>(node))), ctx.epoch, ctx, rank, FlagKind::kNetEntry,
                 static_cast<uint32_t>(node))) {
    return false;
  }
  return entry_signature_ok(flag_load_acquire(net_word(c, layout.net_sig(static_cast<uint32_t>(node)))), ctx.epoch,
                            signature, rank, FlagKind::kNetEntry, ctx);
}

}  // namespace loom::kernels
