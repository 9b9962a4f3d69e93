// reduce_scatter over NVLink: recv[0, bytes) on rank r = sum over s of rank s's send chunk r,
// where send holds W chunks of `bytes` each.
//
// Pull: CTA c reads slice c of chunk `me` from every rank's send (rank order 0..W-1, fp32
// accumulation, one rounding) and writes it to the local recv. It then tells each peer it is
// done reading that peer's send (chunk[me][c]) and waits for the same from every peer, so no
// rank returns (and lets later stream work overwrite its send) while a peer still reads it.
// send must be in the symmetric heap; recv may be any local device memory.
#pragma once

#include <cstdint>

#include "kernels/collectives/common.cuh"
#include "kernels/comm/copy.cuh"
#include "kernels/comm/vector_math.cuh"

namespace loom::kernels {

struct ReduceConfig {
  static constexpr int kThreads = 512;
  static constexpr int kUnroll = 4;  // vectors per thread per source in flight
};

// Reduces `bytes` at byte offset `send_offset` of every rank's heap (rank order 0..W-1) and
// writes the result to `local_out`, or, for all_reduce (kPushToAll), into every rank's heap at
// `recv_offset`. bases[s] = rank s's heap base. With `vectorizable` (all offsets 16-byte
// aligned) whole 16-byte vectors move kUnroll at a time and only a sub-vector tail goes element
// by element; otherwise everything goes element by element (odd shard sizes only).
template <typename T, bool kPushToAll>
__device__ __forceinline__ void reduce_slice(const DeviceComm& c, const uint64_t* bases, uint64_t send_offset,
                                             uint64_t recv_offset, char* local_out, uint64_t bytes,
                                             bool vectorizable) {
  using V = Vec16<T>;
  constexpr int kUnroll = ReduceConfig::kUnroll;
  const int world = c.local_world;
  const uint32_t lane = threadIdx.x;
  const uint32_t lanes = blockDim.x;
  const uint64_t vectors = vectorizable ? bytes / kVectorBytes : 0;
  // Stores `out` (a whole vector or one element) as item `idx` of the result.
  auto store = [&](uint64_t idx, auto out) {
    using Item = decltype(out);
    if constexpr (kPushToAll) {
      for (int i = 1; i <= world; ++i) {
        const int d = (c.local_rank + i) % world;
        reinterpret_cast<Item*>(reinterpret_cast<char*>(bases[d]) + recv_offset)[idx] = out;
      }
    } else {
      reinterpret_cast<Item*>(local_out)[idx] = out;
    }
  };
  for (uint64_t v = lane; v < vectors; v += static_cast<uint64_t>(lanes) * kUnroll) {
    float acc[kUnroll][V::kElems];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int e = 0; e < V::kElems; ++e) acc[u][e] = 0.0f;
    for (int s = 0; s < world; ++s) {
      const uint4* src = reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(bases[s]) + send_offset);
      uint4 in[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint64_t idx = v + static_cast<uint64_t>(u) * lanes;
        in[u] = idx < vectors ? load_peer_vector(src + idx) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) V::add(acc[u], in[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t idx = v + static_cast<uint64_t>(u) * lanes;
      if (idx < vectors) store(idx, V::pack(acc[u]));
    }
  }
  // Elements not covered by whole vectors.
  const uint64_t first = vectors * kVectorBytes / sizeof(T);
  const uint64_t elems = bytes / sizeof(T);
  for (uint64_t i = first + lane; i < elems; i += lanes) {
    float acc = 0.0f;
    for (int s = 0; s < world; ++s) {
      acc += V::to_float(reinterpret_cast<const T*>(reinterpret_cast<const char*>(bases[s]) + send_offset)[i]);
    }
    store(i, V::from_float(acc));
  }
}

// Copies the peer heap bases into shared memory (dynamic smem: local_world * 8 bytes).
__device__ __forceinline__ const uint64_t* stage_peer_bases(const DeviceComm& c, uint64_t* smem_bases) {
  for (int s = threadIdx.x; s < c.local_world; s += blockDim.x) smem_bases[s] = c.peer_heap_bases[s];
  __syncthreads();
  return smem_bases;
}

// all_reduce: the chunk of rank r when `bytes` is cut into `world` chunks with `granule`-aligned
// boundaries.
__device__ __host__ __forceinline__ Slice all_reduce_chunk(uint64_t bytes, int world, int r, uint32_t granule) {
  return slice_of(bytes, static_cast<uint32_t>(world), static_cast<uint32_t>(r), granule);
}

// Both reducing collectives' kernel body: every CTA enters, reduces its slice of this rank's
// chunk (reduce_scatter: chunk me of every rank's send into the local recv; all_reduce, kPushToAll:
// chunk me of the buffer, cut by all_reduce_chunk, into every rank's recv), tells every peer it is
// done and waits for the same from every peer.
template <typename T, bool kPushToAll>
__device__ __forceinline__ void reduce_collective(const CollectiveArgs& a, uint64_t* bases_smem) {
  const DeviceComm& c = a.comm;
  const frame::LaunchFrame f = frame::LaunchFrame::begin(c, static_cast<OpId>(a.op));
  const uint64_t epoch = f.epoch;
  const WaitContext& ctx = f.ctx;
  const uint64_t* bases = stage_peer_bases(c, bases_smem);
  const uint32_t cta = blockIdx.x;

  if (cta_enter_all(c, collective_entry(c), epoch, a.signature, ctx)) {
    const uint32_t granule = a.vectorizable ? kVectorBytes : sizeof(T);
    if constexpr (kPushToAll) {
      const Slice chunk = all_reduce_chunk(a.bytes, c.local_world, c.local_rank, granule);
      const Slice slice = slice_of(chunk.size(), gridDim.x, cta, granule);
      const uint64_t offset = chunk.begin + slice.begin;
      reduce_slice<T, true>(c, bases, a.send_offset + offset, a.recv_offset + offset, nullptr, slice.size(),
                            a.vectorizable != 0);
    } else {
      const Slice slice = slice_of(a.bytes, gridDim.x, cta, granule);
      const uint64_t chunk_offset = a.send_offset + static_cast<uint64_t>(c.local_rank) * a.bytes;
      reduce_slice<T, false>(c, bases, chunk_offset + slice.begin, 0, a.recv + slice.begin, slice.size(),
                             a.vectorizable != 0);
    }
    cta_publish_chunk(c, cta, epoch);  // "done reading your send" to every peer
    cta_wait_chunk_from_all(c, cta, epoch, ctx);
  }
  f.finish(c);
}

template <typename T>
__global__ void __launch_bounds__(ReduceConfig::kThreads, 1) reduce_scatter_kernel(CollectiveArgs a) {
  extern __shared__ __align__(16) uint64_t bases_smem[];  // [local_world]
  reduce_collective<T, false>(a, bases_smem);
}

}  // namespace loom::kernels
