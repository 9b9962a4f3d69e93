// all_gather over NVLink: recv[s * bytes ...] on every rank = rank s's send[0, bytes).
//
// Push: CTA c copies slice c of this rank's shard into every rank's recv (peers first, local
// last), then publishes chunk[me][c]; it finishes when chunk[s][c] arrived from every peer.
// recv must be in the symmetric heap (peers write it); send may be any local device memory.
// Engines: kVector (all threads, 16-byte stores) or kBulk (one thread drives the TMA engine).
#pragma once

#include <cstdint>

#include "kernels/collectives/common.cuh"
#include "kernels/comm/bulk_copy.cuh"
#include "kernels/comm/copy.cuh"
#include "kernels/frame/persistent.cuh"

namespace loom::kernels {

enum class CopyEngine : uint32_t { kVector = 0, kBulk = 1 };

struct AllGatherConfig {
  static constexpr int kThreads = 512;
  static constexpr int kUnroll = 4;        // 16-byte vectors in flight per thread
  static constexpr int kBulkStages = 4;    // TMA ring depth
  static constexpr uint32_t kBulkStageBytes = 16 * 1024;
  using Bulk = BulkCopyStream<kBulkStages, kBulkStageBytes>;
  // Dynamic shared memory: the TMA ring (kBulk only) followed by nothing else.
  static constexpr uint32_t kBulkSmemBytes = Bulk::kSmemBytes;
};

template <CopyEngine kEngine>
__global__ void __launch_bounds__(AllGatherConfig::kThreads, 1) all_gather_kernel(CollectiveArgs a) {
  using Config = AllGatherConfig;
  extern __shared__ __align__(128) char smem[];
  const DeviceComm& c = a.comm;
  const frame::LaunchFrame f = frame::LaunchFrame::begin(c, static_cast<OpId>(a.op));
  const uint64_t epoch = f.epoch;
  const WaitContext& ctx = f.ctx;
  const int me = c.local_rank;
  const int world = c.local_world;
  const uint32_t cta = blockIdx.x;

  if (cta_enter_all(c, collective_entry(c), epoch, a.signature, ctx)) {
    const Slice slice = slice_of(a.bytes, gridDim.x, cta, kVectorBytes);
    const char* src = a.send + slice.begin;
    const uint64_t dst_offset = a.recv_offset + static_cast<uint64_t>(me) * a.bytes + slice.begin;
    bool ok = true;
    if constexpr (kEngine == CopyEngine::kBulk) {
      // The TMA engine needs 16-byte aligned, 16-byte multiple ranges: the host only picks it then.
      if (threadIdx.x == 0) {
        Config::Bulk bulk(reinterpret_cast<uint8_t*>(smem));
        bulk.init();
        for (int i = 1; i <= world && ok; ++i) {
          const int d = (me + i) % world;
          char* dst = peer_heap(c, d) + dst_offset;
          if (dst == src || slice.size() == 0) continue;
          ok = bulk.copy(&dst, 1, src, slice.size(), ctx);
        }
      }
    } else {
      for (int i = 1; i <= world; ++i) {
        const int d = (me + i) % world;
        char* dst = peer_heap(c, d) + dst_offset;
        if (dst != src) vector_copy<Config::kUnroll>(dst, src, slice.size(), threadIdx.x, blockDim.x);
      }
    }
    // A failed bulk copy has recorded the error; publishing anyway is harmless (peers abort too).
    cta_publish_chunk(c, cta, epoch);
    cta_wait_chunk_from_all(c, cta, epoch, ctx);
  }
  f.finish(c);
}

}  // namespace loom::kernels
