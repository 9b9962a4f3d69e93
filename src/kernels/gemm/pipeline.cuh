// PipelineState: one side's position in a ring of kDepth slots guarded by mbarriers (the stage
// ring between a TMA producer and wgmma consumers, the compute role's tile and signal rings):
// the slot index and the phase parity of the current pass, the bounded waits on a slot's
// barriers and the step to the next slot. Separate so that other kernels' pipelines (an
// attention kernel's K/V stages) need not write the stage/phase bookkeeping out again.
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/wait.cuh"
#include "kernels/common/sm90.cuh"

namespace loom::kernels::gemm {

// A ring position as it is kept between calls (in shared memory, RoleState).
struct RingPosition {
  uint32_t index = 0;
  uint32_t phase = 0;
};

// A slot has a "filled" barrier (the producer side completes a phase when the slot holds data)
// and a "released" one (the consumer side completes a phase when it is done with the slot). The
// waits take the barrier of the current slot (the caller knows where its barriers live) and
// record `what` with the slot index if they give up (sm90::mbarrier_wait: bounded, false on
// abort or timeout).
template <int kDepth>
struct PipelineState {
  uint32_t index;  // the slot this side is at, 0 .. kDepth - 1
  uint32_t phase;  // parity of the current pass over the ring

  __device__ static PipelineState at(RingPosition p) { return PipelineState{p.index, p.phase}; }
  __device__ RingPosition position() const { return RingPosition{index, phase}; }

  // Consumer side: waits until the slot has been filled in this pass.
  __device__ __forceinline__ bool wait_filled(uint64_t* bar, const WaitContext& ctx, sm90::BarrierWhat what) const {
    return sm90::mbarrier_wait(bar, phase, ctx, sm90::barrier_what(what, index));
  }
  // Consumer side, without waiting: whether the slot has been filled in this pass already.
  __device__ __forceinline__ bool is_filled(uint64_t* bar) const { return cuda::ptx::mbarrier_test_wait_parity(bar, phase); }
  // Producer side: waits until the slot was released in the previous pass (passes at once in the
  // first pass over a fresh ring, whose barriers count the previous phase as complete).
  __device__ __forceinline__ bool wait_released(uint64_t* bar, const WaitContext& ctx, sm90::BarrierWhat what) const {
    return sm90::mbarrier_wait(bar, phase ^ 1, ctx, sm90::barrier_what(what, index));
  }
  __device__ __forceinline__ void advance() {
    if (++index == kDepth) {
      index = 0;
      phase ^= 1;
    }
  }
};

}  // namespace loom::kernels::gemm
