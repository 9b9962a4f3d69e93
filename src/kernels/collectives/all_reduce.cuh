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

// Chunk of rank r when `bytes` is cut into `world` chunks with `granule`-aligned boundaries.
__device__ __host__ __forceinline__ Slice all_reduce_chunk(uint64_t bytes, int world, int r, uint32_t granule) {
  return slice_of(bytes, static_cast<uint32_t>(world), static_cast<uint32_t>(r), granule);
}

template <typename T>
__global__ void __launch_bounds__(ReduceConfig::kThreads, 1) all_reduce_kernel(CollectiveArgs a) {
  extern __shared__ __align__(16) uint64_t bases_smem[];  // [local_world]
  const DeviceComm& c = a.comm;
  const frame::LaunchFrame f = frame::LaunchFrame::begin(c, static_cast<OpId>(a.op));
  const uint64_t epoch = f.epoch;
  const WaitContext& ctx = f.ctx;
  const uint64_t* bases = stage_peer_bases(c, bases_smem);
  const uint32_t cta = blockIdx.x;

  if (cta_enter_all(c, collective_entry(c), epoch, a.signature, ctx)) {
    const uint32_t granule = a.vectorizable ? kVectorBytes : sizeof(T);
    const Slice chunk = all_reduce_chunk(a.bytes, c.local_world, c.local_rank, granule);
    const Slice slice = slice_of(chunk.size(), gridDim.x, cta, granule);
    const uint64_t offset = chunk.begin + slice.begin;
    reduce_slice<T, true>(c, bases, a.send_offset + offset, a.recv_offset + offset, nullptr, slice.size(),
                          a.vectorizable != 0);
    cta_publish_chunk(c, cta, epoch);
    cta_wait_chunk_from_all(c, cta, epoch, ctx);
  }
  f.finish(c);
}

}  // namespace loom::kernels
