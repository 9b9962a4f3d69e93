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

}  // namespace loom::kernels
