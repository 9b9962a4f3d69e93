// What the MoE kernels (routing.cuh, dispatch.cuh, combine.cuh) share beyond the kernel frame
// (kernels/frame/): their entry words, the workspace as seen from a rank, and small warp helpers.
//
// Entry words: the MoE launches use the control region's entered[] words (ControlLayout), which
// the collectives use too. They are the node's words that are zero from the communicator's
// creation on and never zeroed again: an entry word is written by a peer at the very start of its
// launch, before any handshake, so it cannot live in the MoE workspace, which every MoE call
// zeroes in part just before its kernel (kernels/moe/layout.h). Sharing is safe: every launch of
// a communicator has its own epoch, so a word always says "rank s entered epoch e with plan
// signature S", whichever family wrote it, and two families can never meet in one epoch unless
// the ranks' call sequences diverged, which the signature check then reports.
#pragma once

#include <cstdint>

#include "kernels/comm/entry.cuh"
#include "kernels/comm/net.cuh"
#include "kernels/moe/layout.h"
#include "runtime/device_abi.h"

namespace loom::kernels::moe {

__device__ __forceinline__ EntryWords moe_entry(const DeviceComm& c) { return {c.control.entered_offset}; }

// The MoE workspace of local rank `rank` (its mapping here), at the same heap offset everywhere.
struct Workspace {
  uint64_t offset;  // heap offset of the workspace
  WorkspaceLayout layout;

  __device__ char* base(const DeviceComm& c, int rank) const {
    return reinterpret_cast<char*>(c.peer_heap_bases[rank] + offset);
  }
  template <class T>
  __device__ T* at(const DeviceComm& c, int rank, uint64_t region, uint64_t index = 0) const {
    return reinterpret_cast<T*>(base(c, rank) + region) + index;
  }
};

// The fields every MoE kernel's parameters start with (the host fills them in one place).
struct LaunchCommon {
  DeviceComm comm;
  LaunchState* state;  // the MoE family's
  Workspace ws;
};


// What dispatch and combine read of the routing's plan buffer (PlanLayout regions).
struct PlanView {
  const MoeStatusWords* status;
  const int32_t* slot_dest;  // [T * k]
  const float* slot_weight;  // [T * k]
};

__device__ __forceinline__ uint32_t lane_id() { return threadIdx.x & 31u; }
__device__ __forceinline__ uint32_t warp_id() { return threadIdx.x >> 5; }
__device__ __forceinline__ uint32_t lanes_below() { return (1u << lane_id()) - 1u; }

// Adds 1 to a counter another GPU (or this one) waits on: a release reduction at system scope,
// so the writes this thread made or observed before (the row and its origin, fenced) are
// visible to whoever reads the count.
__device__ __forceinline__ void counter_add_release(uint64_t* counter, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(counter), "l"(v) : "memory");
}

// A slot destination read from the plan, or kNoSlot when it is not one (d * C + row < W * C). A
// plan always holds valid ones; this guard keeps a launch that follows a failed routing (its
// plan half written) from addressing memory outside the receive buffers.
__device__ __forceinline__ int32_t valid_slot(int32_t dest, uint32_t world, uint32_t capacity) {
  return dest >= 0 && static_cast<uint64_t>(dest) < static_cast<uint64_t>(world) * capacity ? dest : kNoSlot;
}
// This rank's kept receive rows from the plan's status words, within [0, C] for the same reason.
__device__ __forceinline__ uint64_t kept_rows(const MoeStatusWords& st, uint32_t capacity) {
  const int64_t kept = st.kept_rows;
  return kept < 0 ? 0 : min(static_cast<uint64_t>(kept), static_cast<uint64_t>(capacity));
}

// All threads: whether `ok` holds on every thread of the CTA (a barrier).
__device__ __forceinline__ bool cta_all(bool ok) { return __syncthreads_and(ok ? 1 : 0) != 0; }

}  // namespace loom::kernels::moe
