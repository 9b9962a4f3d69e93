// all_reduce over NVLink (two-shot): recv on every rank = sum over s of rank s's send.
//
// The buffer is cut into W chunks (16-byte aligned boundaries); rank r owns chunk r. CTA c
// pulls slice c of chunk `me` from every rank's send (rank order, fp32 accumulation, one
// rounding), then pushes the result into every rank's recv and publishes chunk[me][c]. It
// finishes when every peer's slice c of its own chunk has arrived. That arrival also means the
// peer finished reading our send, so no end barrier is needed. send and recv must both be in
// the symmetric heap; send == recv (in place) is allowed: each element is read by exactly one
// thread before that thread overwrites it.
#pragma once

#include <cstdint>

#include "kernels/collectives/reduce_scatter.cuh"

namespace loom::kernels {

template <typename T>
__global__ void __launch_bounds__(ReduceConfig::kThreads, 1) all_reduce_kernel(CollectiveArgs a) {
  extern __shared__ __align__(16) uint64_t bases_smem[];  // [local_world]
  reduce_collective<T, true>(a, bases_smem);  // reduce_scatter.cuh
}

}  // namespace loom::kernels
