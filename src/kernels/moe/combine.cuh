// moe_combine: each token's weighted sum of its expert outputs, back at the token's owner:
//   out[t] = sum over routed slots j = 0, 1, ..., k-1 (in that order) of w[t, j] * y[row(t, j)]
// in fp32 (fused multiply-adds, one rounding to the output type at the end), where y is the
// expert output buffer (symmetric, rows in the receive layout) and row(t, j) the slot's row on
// the rank holding its expert (the routing's slot_dest). The order is fixed, so every run is
// bit-identical; a token without routed slots gets zeros.
//
// The owner pulls: warp w takes tokens w, w + warps, ... and reads each slot's row over NVLink
// (16-byte loads that bypass L1) after that rank's entry word of this launch (its expert outputs
// are complete: its stream reached the combine). Roles (CombineRoleTable): every CTA reduces; the
// finisher CTA then waits (bounded) for every CTA's read_done flag, tells every rank it is done
// reading its outputs (done[me] = e there, after its entry), and waits for every rank's done[]:
// a rank's launch ends only once nobody reads its outputs any more, so its stream may overwrite
// them next. When the routing failed nothing is read or written (the handshake still runs).
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
#include "kernels/moe/flags.h"
#include "kernels/moe/layout.h"

namespace loom::kernels::moe {

enum class CombineRole : uint32_t {
  kFinisher = 0,  // one CTA: reduces its tokens, then the done handshake with every rank
  kReduce = 1,    // the rest: reduce their tokens
};
using CombineRoleTable = frame::RoleTable<CombineRole, CombineRole::kReduce>;

struct CombineParams : LaunchCommon {
  PlanView plan;                 // the routing's
  const float* weights;          // [T * k]: the caller's, or the routing's copy (plan.slot_weight)
  uint64_t y_offset;             // heap offset of the expert outputs [C, H']
  uint64_t row_bytes;            // H' * element size (a multiple of 16)
  char* out;                     // [T, H'] local
  uint32_t num_tokens;
  uint32_t top_k;
  uint32_t capacity;
  uint32_t signature;
  CombineRoleTable roles;
};
static_assert(sizeof(CombineParams) <= 4096, "moe_combine's parameters must fit the classic 4 KiB limit");

// One warp: tokens first, first + stride, ... False after a failed wait (recorded).
template <typename T>
__device__ __forceinline__ bool reduce_tokens(const CombineParams& p, uint32_t first, uint32_t stride, uint64_t epoch,
                                              const WaitContext& ctx) {
  using V = Vec16<T>;
  const DeviceComm& c = p.comm;
  const uint32_t lane = lane_id();
  const uint32_t k = p.top_k;
  const uint32_t cap = p.capacity;
  const uint64_t vectors = p.row_bytes / kVectorBytes;
  uint32_t entered = 1u << c.local_rank;  // ranks whose entry this warp has seen (lane-uniform)
  for (uint32_t t = first; t < p.num_tokens; t += stride) {
    // Lane j < k: slot j's row (its address on its rank) and weight.
    const uint64_t q = static_cast<uint64_t>(t) * k + lane;
    const int32_t dest = lane < k ? valid_slot(p.plan.slot_dest[q], c.local_world, cap) : kNoSlot;
    const uint32_t owner = dest != kNoSlot ? static_cast<uint32_t>(dest) / cap : 0;
    const float w = dest != kNoSlot ? p.weights[q] : 0.0f;
    const uint64_t row_addr = dest != kNoSlot ? c.peer_heap_bases[owner] + p.y_offset +
                                                    static_cast<uint64_t>(static_cast<uint32_t>(dest) - owner * cap) * p.row_bytes
                                              : 0;
    uint32_t unseen = __ballot_sync(0xffffffffu, dest != kNoSlot && (entered & (1u << owner)) == 0);
    while (unseen != 0) {
      const uint32_t d = __shfl_sync(0xffffffffu, owner, __ffs(unseen) - 1);
      bool ok = true;
      if (lane == 0) ok = wait_entry(c, moe_entry(c), static_cast<int>(d), epoch, p.signature, ctx);
      if (!__shfl_sync(0xffffffffu, ok, 0)) return false;
      entered |= 1u << d;
      unseen &= ~__ballot_sync(0xffffffffu, dest != kNoSlot && owner == d);
      __syncwarp();  // the warp's loads from d are ordered after lane 0's acquire of its entry
    }
    uint4* out = reinterpret_cast<uint4*>(p.out + static_cast<uint64_t>(t) * p.row_bytes);
    // All 32 lanes run every pass of this loop (warp-uniform bounds), so the full-mask shuffles
    // below always meet the whole warp; lane `lane` handles vector base + lane when it exists.
    // (Iterating v = lane, lane + 32, ... instead hangs the warp whenever the row's vector count is
    // not a multiple of 32: the lanes with one more vector shuffle alone, waiting for lanes that
    // already left the loop.)
    for (uint64_t base = 0; base < vectors; base += 32) {
      const uint64_t v = base + lane;
      const bool live = v < vectors;
      float acc[V::kElems];
#pragma unroll
      for (int i = 0; i < V::kElems; ++i) acc[i] = 0.0f;
      for (uint32_t j = 0; j < k; ++j) {
        const uint64_t addr = __shfl_sync(0xffffffffu, row_addr, j);
        const float wj = __shfl_sync(0xffffffffu, w, j);
        if (addr == 0 || !live) continue;  // slot j is not routed (warp-uniform), or no vector here
        float y[V::kElems];
#pragma unroll
        for (int i = 0; i < V::kElems; ++i) y[i] = 0.0f;
        V::add(y, load_peer_vector(reinterpret_cast<const uint4*>(addr) + v));  // 0 + y: exact
#pragma unroll
        for (int i = 0; i < V::kElems; ++i) acc[i] = __fmaf_rn(wj, y[i], acc[i]);
      }
      if (live) out[v] = V::pack(acc);
    }
  }
  return true;
}

// The finisher CTA (all threads), after its own tokens: every CTA has read, then the done
// handshake with every rank. False after a failed wait (recorded).
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
  bool ok = true;
  if (p.plan.status->code == 0) {
    const uint32_t warps = gridDim.x * MoeTunables::kWarps;
    ok = reduce_tokens<T>(p, blockIdx.x * MoeTunables::kWarps + warp_id(), warps, f.epoch, f.ctx);
  }
  if (cta_all(ok)) {
    if (threadIdx.x == 0) flag_store_release(p.ws.at<uint64_t>(c, c.local_rank, p.ws.layout.read_done, blockIdx.x), f.epoch);
    if (p.roles.role_of(blockIdx.x) == CombineRole::kFinisher) (void)finish_reads(p, f.epoch, f.ctx);
  }
  f.mark(LaunchPhase::kRolesDone);
  f.finish(p.state, c);
}

}  // namespace loom::kernels::moe
