// Pieces shared by loom's NVLink collectives (all_gather, reduce_scatter, all_reduce).
//
// Protocol, per launch with epoch e, on every local rank `me` of W:
//   1. enter:   the entry handshake (kernels/comm/entry.cuh, cta_enter_all) over the control
//               region's entered[]: every CTA tells every peer, then waits until every peer s
//               entered e: peers' inputs are ready and their receive buffers are no longer in
//               use by earlier stream work.
//   2. move:    CTA c handles slice c of the data (slices are 16-byte aligned byte ranges).
//   3. publish: CTA c stores chunk[me][c] = e into each peer it wrote to (after a system fence).
//   4. finish:  CTA c waits for chunk[s][c] >= e from every peer s it depends on.
// Every wait is the bounded wait; a CTA that fails skips to the end and still counts itself in
// finish_launch so the epoch advances.
#pragma once

#include <cstdint>

#include "kernels/comm/entry.cuh"
#include "kernels/comm/epoch.cuh"
#include "kernels/comm/signals.cuh"
#include "kernels/comm/wait.cuh"
#include "kernels/frame/persistent.cuh"
#include "runtime/device_abi.h"

namespace loom::kernels {

// Parameters every collective kernel takes (passed by value).
struct CollectiveArgs {
  DeviceComm comm;
  const char* send;      // this rank's input (a heap pointer when peers read it)
  char* recv;            // this rank's output
  uint64_t send_offset;  // heap offset of `send` (valid when peers read it)
  uint64_t recv_offset;  // heap offset of `recv` (valid when peers write it)
  uint64_t bytes;        // per-rank payload: AG shard, RS output, AR whole buffer
  uint32_t vectorizable; // all bases and chunk boundaries are 16-byte aligned
  uint32_t op;           // OpId recorded on failure: the collective, or the operator it serves
  uint32_t signature;    // what peers must have entered this launch with (ops/launch/signature.h)
};

__device__ __forceinline__ char* peer_heap(const DeviceComm& c, int peer) {
  return reinterpret_cast<char*>(c.peer_heap_bases[peer]);
}

__device__ __forceinline__ uint64_t* peer_flag(const DeviceComm& c, int peer, uint64_t offset) {
  return reinterpret_cast<uint64_t*>(peer_heap(c, peer) + offset);
}

// The collectives' entry words (kernels/comm/entry.cuh): the control region's entered[], with the
// call's signature (CollectiveArgs::signature).
__device__ __forceinline__ EntryWords collective_entry(const DeviceComm& c) { return {c.control.entered_offset}; }

__device__ __forceinline__ uint64_t* chunk_flag(const DeviceComm& c, int owner, int src, uint32_t chunk) {
  return peer_flag(c, owner, c.control.chunk_offset + 8ull * (static_cast<uint64_t>(src) * c.control.max_chunks + chunk));
}

// Step 3: every thread calls this after its writes; one thread per peer publishes.
__device__ __forceinline__ void cta_publish_chunk(const DeviceComm& c, uint32_t chunk, uint64_t epoch) {
  __syncthreads();
  const int peer = static_cast<int>(threadIdx.x);
  if (peer < c.local_world && peer != c.local_rank) {
    __threadfence_system();
    flag_store_release(chunk_flag(c, peer, c.local_rank, chunk), epoch);
  }
}

// Step 4. Returns the same answer on every thread of the CTA.
__device__ __forceinline__ bool cta_wait_chunk_from_all(const DeviceComm& c, uint32_t chunk, uint64_t epoch,
                                                        const WaitContext& ctx) {
  __shared__ int ok_shared;
  if (threadIdx.x == 0) {
    int ok = 1;
    for (int s = 0; s < c.local_world && ok; ++s) {
      if (s == c.local_rank) continue;
      ok = wait_flag(chunk_flag(c, c.local_rank, s, chunk), epoch, ctx, s, FlagKind::kChunk, chunk);
    }
    ok_shared = ok;
  }
  __syncthreads();
  const bool ok = ok_shared != 0;
  __syncthreads();
  return ok;
}

// Byte range [begin, end) of slice `index` when `bytes` is cut into `parts` slices whose
// boundaries are multiples of `granule` (16 for vector paths, the element size otherwise).
struct Slice {
  uint64_t begin;
  uint64_t end;
  __device__ __host__ uint64_t size() const { return end - begin; }
};

__device__ __host__ __forceinline__ Slice slice_of(uint64_t bytes, uint32_t parts, uint32_t index, uint32_t granule) {
  const uint64_t granules = (bytes + granule - 1) / granule;
  const uint64_t per = (granules + parts - 1) / parts;
  uint64_t begin = per * index * granule;
  uint64_t end = begin + per * granule;
  if (begin > bytes) begin = bytes;
  if (end > bytes) end = bytes;
  return {begin, end};
}

}  // namespace loom::kernels
