// The MoE family's network windows (jobs of several nodes): each rank sends, per remote node, a
// window of fixed-size entries (dispatch: token entries; combine: fp32 partial rows) to its
// same-index GPU there, K = kNetChunkTokens entries per network write. Entries are written by
// any warp in any order into positions taken from a counter; the thread whose entry completes a
// chunk hands the chunk to the proxy (one write, then the chunk's flag at the receiver), so no
// role waits for a whole window and no entry crosses the network twice.
//
// Ordering: a writer fences at system scope after its entry, then adds 1 to the chunk's count
// (relaxed); the completing thread fences at system scope after its add (the chain of adds
// orders every writer's entry before it), then pushes the command, whose header is published
// with a release store at system scope (kernels/comm/command_ring.cuh). The proxy reads the
// entries only after it has read the command.
#pragma once

#include <cstdint>

#include "kernels/comm/net.cuh"
#include "kernels/comm/wait.cuh"
#include "kernels/moe/common.cuh"
#include "kernels/moe/flags.h"
#include "kernels/moe/layout.h"

namespace loom::kernels::moe {

// One window: this rank's entries for remote slot `slot` (node n), sent into its same-index GPU's
// window for this rank's node.
struct NetWindow {
  uint32_t* chunk_count;  // [Q] entries written into each chunk (workspace, zeroed per call)
  uint64_t* sent;         // chunks handed to the proxy (workspace, zeroed per call)
  uint64_t src_offset;    // heap offset of this rank's window (its entry 0)
  uint64_t dst_offset;    // heap offset of the receiver's window for this rank's node (its entry 0)
  uint64_t entry_bytes;
  uint32_t entries;       // entries the window holds in this call
  uint32_t flag_base;     // the receiver's network flag of chunk 0
  int node;               // the receiver's node
  int peer;               // the receiver (rank of the job)
};

LOOM_HOST_DEVICE constexpr uint32_t window_chunks(uint32_t entries) {
  return (entries + MoeTunables::kNetChunkTokens - 1) / MoeTunables::kNetChunkTokens;
}

// One thread, after entry `pos` of window `w` is written and fenced at system scope: counts it;
// the entry completing its chunk hands the chunk to the proxy (after the receiver's network entry,
// bit `node` of `net_entered` caching it). False after a failed (recorded) wait.
__device__ __forceinline__ bool net_window_written(const DeviceComm& c, const NetWindow& w, uint32_t pos,
                                                   uint32_t signature, uint64_t& net_entered, const WaitContext& ctx) {
  constexpr uint32_t kChunk = MoeTunables::kNetChunkTokens;
  const uint32_t chunk = pos / kChunk;
  const uint32_t size = min(kChunk, w.entries - chunk * kChunk);
  if (atomicAdd(w.chunk_count + chunk, 1u) + 1 != size) return true;
  __threadfence_system();  // every entry of the chunk (their writers fenced before their adds)
  if (((net_entered >> w.node) & 1) == 0) {
    if (!wait_network_entry(c, w.node, signature, ctx)) return false;
    net_entered |= 1ull << w.node;
  }
  const uint64_t at = static_cast<uint64_t>(chunk) * kChunk * w.entry_bytes;
  if (!net_put(c, chunk, w.peer, w.src_offset + at, w.dst_offset + at, size * w.entry_bytes, w.flag_base + chunk, ctx)) {
    return false;
  }
  __threadfence();
  atomicAdd(reinterpret_cast<unsigned long long*>(w.sent), 1ull);
  return true;
}

// One thread, at the end of a launch: every chunk of this rank's windows `sent[0, remote)` was
// handed to the proxy (`chunks(i)` of window i), then the proxy has sent them all (the windows
// are the launch's network sources; the next call may overwrite them). False after a failed wait.
template <class Chunks>
__device__ __forceinline__ bool net_windows_drained(const DeviceComm& c, const uint64_t* sent, uint32_t remote,
                                                    Chunks chunks, FlagKind kind, const WaitContext& ctx) {
  for (uint32_t i = 0; i < remote; ++i) {
    if (!wait_flag(sent + i, chunks(i), ctx, -1, kind, i)) return false;
  }
  return net_wait_proxy_done(c, ctx);
}

}  // namespace loom::kernels::moe
