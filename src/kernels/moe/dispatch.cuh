// moe_dispatch: every routed token row to the ranks holding its experts, into the receive layout
// the routing computed (kernels/moe/routing.cuh): the roles of one persistent kernel on the frame
// (moe_dispatch_kernel, dispatch_kernel.cuh; moe_dispatch_gemm runs them too, dispatch_gemm.cuh).
//
// Roles (DispatchRoleTable): CTAs [0, arrival_ctas) receive, the rest push.
//   push     warp w of the pushing CTAs takes tokens w, w + warps, ...; for each destination rank
//            d among the token's routed slots (once per rank, whatever the number of its experts
//            there): waits (bounded, once per warp and rank) for d's entry word of this launch,
//            copies the row with 16-byte vector stores into its FIRST row on d (the primary: the
//            smallest of its rows there, as the layout is expert-major), writes the RecvRow origin
//            of each of its rows on d (token, source rank and slot, weight, primary), fences at
//            system scope, and adds 1 to d's arrival counter of each of those rows' blocks.
//            So a token crosses NVLink once per destination rank.
//   arrival  CTA i of the arrival role takes receive blocks f = i, i + arrival_ctas, ... of this
//            rank's kept rows (R = kArrivalRows rows each): waits (bounded) until arrival[f] holds
//            the block's row count (every row's sender has added its 1, so every primary row in
//            the block has landed and every other row's origin is there, its primary landed too,
//            being no later in the order), copies each repeated row from its primary (local
//            copies), then sets ready[f] = e. A kernel reading this rank's rows (the grouped GEMM
//            of the fused moe_dispatch_gemm, dispatch_gemm.cuh) gates on ready[].
//            When its blocks are done every row sent to this rank has landed, so the launch ends
//            only after every write into this rank (the frame's rule).
// Counters are the one non-epoch word: zeroed by the host call before the kernel (stream order),
// added to only after this rank's entry of the launch, read back against the block's row count.
//
// Buffers (heap offsets equal on all ranks; layout in kernels/moe/layout.h):
//   x        [T, H] this rank's tokens (local)
//   recv_x   [C, H] symmetric: rows [0, kept) in the receive layout, the rest untouched
//   rows     RecvRow [C] in the MoE workspace; arrival / ready [ceil(C / R)] there too
#pragma once

#include <cstdint>

#include "kernels/comm/copy.cuh"
#include "kernels/comm/entry.cuh"
#include "kernels/comm/signals.cuh"
#include "kernels/comm/wait.cuh"
#include "kernels/frame/persistent.cuh"
#include "kernels/frame/role_table.h"
#include "kernels/moe/common.cuh"
#include "kernels/moe/flags.h"
#include "kernels/moe/layout.h"

namespace loom::kernels::moe {

enum class DispatchRole : uint32_t {
  kArrival = 0,  // waits for this rank's receive blocks, copies repeated tokens, sets ready[]
  kPush = 1,     // pushes this rank's token rows to their destination ranks
};
using DispatchRoleTable = frame::RoleTable<DispatchRole, DispatchRole::kPush>;

struct DispatchParams : LaunchCommon {
  PlanView plan;                 // the routing's
  const char* x;                 // [T, H]
  uint64_t recv_offset;          // heap offset of recv_x
  uint64_t row_bytes;            // H * element size (a multiple of 16)
  uint32_t num_tokens;           // T
  uint32_t top_k;
  uint32_t capacity;             // C
  uint32_t signature;
  DispatchRoleTable roles;
};
static_assert(sizeof(DispatchParams) <= 4096, "moe_dispatch's parameters must fit the classic 4 KiB limit");

// One pushing warp: every destination of tokens t = first, first + stride, ... False after a
// failed wait (recorded).
__device__ __forceinline__ bool push_tokens(const DispatchParams& p, uint32_t first, uint32_t stride, uint64_t epoch,
                                            const WaitContext& ctx) {
  const DeviceComm& c = p.comm;
  const WorkspaceLayout& l = p.ws.layout;
  const uint32_t lane = lane_id();
  const int me = c.local_rank;
  const uint32_t cap = p.capacity;
  uint32_t entered = 1u << me;  // ranks whose entry this warp has seen (lane-uniform)
  for (uint32_t t = first; t < p.num_tokens; t += stride) {
    const uint64_t q = static_cast<uint64_t>(t) * p.top_k + lane;
    const int32_t dest = lane < p.top_k ? valid_slot(p.plan.slot_dest[q], c.local_world, cap) : kNoSlot;
    const uint32_t owner = dest != kNoSlot ? static_cast<uint32_t>(dest) / cap : 0;
    const uint32_t row = dest != kNoSlot ? static_cast<uint32_t>(dest) - owner * cap : 0;
    uint32_t pending = __ballot_sync(0xffffffffu, dest != kNoSlot);
    while (pending != 0) {
      const uint32_t d = __shfl_sync(0xffffffffu, owner, __ffs(pending) - 1);
      const bool mine = dest != kNoSlot && owner == d;  // this lane's slot goes to rank d
      const uint32_t group = __ballot_sync(0xffffffffu, mine);
      const uint32_t primary = __reduce_min_sync(0xffffffffu, mine ? row : 0xffffffffu);
      if ((entered & (1u << d)) == 0) {
        bool ok = true;
        if (lane == 0) ok = wait_entry(c, moe_entry(c), static_cast<int>(d), epoch, p.signature, ctx);
        if (!__shfl_sync(0xffffffffu, ok, 0)) return false;
        __syncwarp();  // the warp's stores into d are ordered after lane 0's acquire of its entry
        entered |= 1u << d;
      }
      char* recv = reinterpret_cast<char*>(c.peer_heap_bases[d] + p.recv_offset);
      vector_copy<MoeTunables::kCopyUnroll>(recv + static_cast<uint64_t>(primary) * p.row_bytes,
                                            p.x + static_cast<uint64_t>(t) * p.row_bytes, p.row_bytes, lane, 32);
      if (mine) {
        const RecvRow origin{static_cast<int32_t>(t), (me << 8) | static_cast<int32_t>(lane), p.plan.slot_weight[q],
                             static_cast<int32_t>(primary)};
        *p.ws.at<RecvRow>(c, static_cast<int>(d), l.rows, row) = origin;
      }
      __threadfence_system();
      __syncwarp();
      if (mine) counter_add_release(p.ws.at<uint64_t>(c, static_cast<int>(d), l.arrival, row / MoeTunables::kArrivalRows), 1);
      pending &= ~group;
    }
  }
  return true;
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
  const uint32_t mine = first < blocks ? (blocks - first + stride - 1) / stride : 0;
  auto rows_of = [&](uint32_t f) {
    return min(static_cast<uint64_t>(MoeTunables::kArrivalRows), kept - static_cast<uint64_t>(f) * MoeTunables::kArrivalRows);
  };
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
