// Launch epochs kept on the device, so that CUDA-graph replays advance them without host work.
//
// Every loom kernel reads the epoch of the previous completed launch at entry (stream order
// guarantees the previous launch is finished) and uses epoch + 1. When a CTA is done it counts
// itself; the last one stores the new epoch and resets the counter for the next launch.
#pragma once

#include <cstdint>

#include "runtime/device_abi.h"

namespace loom::kernels {

__device__ __forceinline__ uint64_t launch_epoch(const EpochState* state) {
  return *reinterpret_cast<const volatile uint64_t*>(&state->epoch) + 1;
}

// Called by one thread of every CTA of the launch, after all of that CTA's work (also when the
// CTA gave up after a failed wait, so aborted launches still advance the epoch).
__device__ __forceinline__ void finish_launch(EpochState* state, uint64_t epoch) {
  __threadfence();
  const uint32_t done = atomicAdd(&state->ctas_finished, 1u) + 1;
  if (done == gridDim.x * gridDim.y * gridDim.z) {
    state->ctas_finished = 0;
    *reinterpret_cast<volatile uint64_t*>(&state->epoch) = epoch;
    __threadfence();
  }
}

// For kernels whose CTAs take tiles from a launch-wide queue (`State` has uint32_t tile_queue
// and ctas_done: LaunchState): one thread of every CTA, once the CTA claims no more tiles (also
// after a failure). The CTA that leaves last resets the queue; the next launch on the stream runs
// after this one completes (stream order), so it sees the zeros.
template <class State>
__device__ __forceinline__ void leave_queue(State* state) {
  __threadfence();
  const uint32_t done = atomicAdd(&state->ctas_done, 1u) + 1;
  if (done == gridDim.x * gridDim.y * gridDim.z) {
    state->tile_queue = 0;
    state->ctas_done = 0;
    __threadfence();
  }
}

// leave_queue and finish_launch: thread 0 of every CTA, after all of the CTA's work.
template <class State>
__device__ __forceinline__ void finish_queued_launch(State* state, EpochState* epoch_state, uint64_t epoch) {
  leave_queue(state);
  finish_launch(epoch_state, epoch);
}

}  // namespace loom::kernels
