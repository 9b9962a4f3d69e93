// Peer copy helpers: move bytes from local memory to local or peer (NVLink-mapped) memory.
//
// Two engines, both used by the collectives and later by the fused operators' copy roles:
//  - vector_copy: every thread moves 16-byte vectors, kUnroll loads in flight before the
//    stores (stores to peer memory are posted writes, so throughput needs loads in flight).
//  - BulkCopier: one thread drives the TMA bulk engine (cp.async.bulk global->shared, then
//    shared->global to each destination) through a ring of shared-memory stages, so a copy
//    CTA spends almost no issue slots.
// Neither writes a flag; callers publish one (a system fence, then flag_store_release) once the
// data is complete.
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/signals.cuh"
#include "kernels/comm/wait.cuh"

namespace loom::kernels {

constexpr uint32_t kVectorBytes = 16;

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & (kVectorBytes - 1)) == 0;
}

// Copies `bytes` from src to dst with threads [lane, lane + nlanes*k ...) of the caller's group.
// dst and src may have any alignment; when both share the same offset modulo 16 the bulk moves
// as 16-byte vectors, otherwise (only for odd-sized shards) byte by byte.
template <int kUnroll>
__device__ __forceinline__ void vector_copy(char* dst, const char* src, uint64_t bytes, uint32_t lane,
                                            uint32_t nlanes) {
  static_assert(kUnroll >= 1 && kUnroll <= 16, "vector_copy: kUnroll must be between 1 and 16");
  const uint32_t dst_mis = reinterpret_cast<uintptr_t>(dst) & (kVectorBytes - 1);
  const uint32_t src_mis = reinterpret_cast<uintptr_t>(src) & (kVectorBytes - 1);
  if (dst_mis != src_mis) {
    for (uint64_t i = lane; i < bytes; i += nlanes) dst[i] = src[i];
    return;
  }
  uint64_t head = dst_mis == 0 ? 0 : kVectorBytes - dst_mis;
  if (head > bytes) head = bytes;
  for (uint64_t i = lane; i < head; i += nlanes) dst[i] = src[i];
  dst += head;
  src += head;
  bytes -= head;

  const uint64_t vectors = bytes / kVectorBytes;
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(dst);
  const uint64_t step = static_cast<uint64_t>(nlanes) * kUnroll;
  uint64_t v = lane;
  for (; v + (kUnroll - 1) * static_cast<uint64_t>(nlanes) < vectors; v += step) {
    uint4 buf[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) buf[u] = s[v + static_cast<uint64_t>(u) * nlanes];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) d[v + static_cast<uint64_t>(u) * nlanes] = buf[u];
  }
  for (; v < vectors; v += nlanes) d[v] = s[v];

  const uint64_t tail_begin = vectors * kVectorBytes;
  for (uint64_t i = tail_begin + lane; i < bytes; i += nlanes) dst[i] = src[i];
}

// Bounded wait on a local mbarrier phase (TMA completion). Hardware completes these, but a
// load from a peer that vanished must not hang the kernel, so the deadline still applies.
__device__ __forceinline__ bool mbarrier_wait_bounded(uint64_t* bar, uint32_t parity, const WaitContext& ctx) {
  if (cuda::ptx::mbarrier_try_wait_parity(bar, parity)) return true;
  WaitGuard<kBarrierHostAbortCheckNs> guard(ctx.deadline_ns);  // the host's word only in a long wait
  for (uint32_t polls = 1;; ++polls) {
    if (cuda::ptx::mbarrier_try_wait_parity(bar, parity)) return true;
    if (polls % kAbortCheckInterval == 0 &&
        !guard.keep_waiting(ctx, -1, FlagKind::kNone, static_cast<uint32_t>(BarrierWhat::kCopyLoad) << 16, 0)) {
      return false;
    }
  }
}

// TMA bulk copy of one source range to several destinations, driven by a single thread.
//
// Shared memory (provided by the caller, 128-byte aligned):
//   stage[kStages][kStageBytes]  data ring           kStages * kStageBytes bytes
//   full[kStages]                mbarriers (uint64)  kStages * 8 bytes
// Load of chunk i lands in stage i % kStages; its stores to all destinations form one bulk
// group. Before chunk i + kStages - 1 reuses the stage of chunk i - 1, wait_group.read<1>
// guarantees the stores of chunk i - 1 have finished reading it.
template <int kStages, uint32_t kStageBytes>
struct BulkCopier {
  static_assert(kStages >= 2, "BulkCopier needs at least two stages to overlap loads and stores");
  static_assert(kStageBytes % kVectorBytes == 0, "BulkCopier stage size must be a multiple of 16 bytes");
  static constexpr uint32_t kSmemBytes = kStages * kStageBytes + kStages * sizeof(uint64_t);

  char* stages;
  uint64_t* full;

  __device__ static BulkCopier carve(char* smem) {
    BulkCopier c;
    c.stages = smem;
    c.full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
    return c;
  }

  // Called by one thread before the first copy; the caller syncs the CTA afterwards.
  __device__ void init() const {
    for (int s = 0; s < kStages; ++s) cuda::ptx::mbarrier_init(&full[s], 1);
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
  }

  // Copies src[0, bytes) to dsts[d][0, bytes) for d < ndst. src and every dst must be 16-byte
  // aligned and bytes a multiple of 16. `phase_base` counts chunks copied by earlier calls on
  // this CTA (mbarrier phases continue across calls); returns the updated count or ~0 on failure.
  __device__ uint64_t copy(char* const* dsts, int ndst, const char* src, uint64_t bytes, uint64_t phase_base,
                           const WaitContext& ctx) const {
    const uint64_t chunks = (bytes + kStageBytes - 1) / kStageBytes;
    auto chunk_size = [&](uint64_t i) -> uint32_t {
      const uint64_t left = bytes - i * kStageBytes;
      return static_cast<uint32_t>(left < kStageBytes ? left : kStageBytes);
    };
    auto issue_load = [&](uint64_t i) {
      const uint32_t s = static_cast<uint32_t>((phase_base + i) % kStages);
      const uint32_t size = chunk_size(i);
      cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                           &full[s], size);
      cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, stages + s * kStageBytes,
                               src + i * kStageBytes, size, &full[s]);
    };
    const uint64_t prologue = chunks < kStages - 1 ? chunks : kStages - 1;
    for (uint64_t i = 0; i < prologue; ++i) issue_load(i);
    for (uint64_t i = 0; i < chunks; ++i) {
      const uint64_t seq = phase_base + i;
      const uint32_t s = static_cast<uint32_t>(seq % kStages);
      if (!mbarrier_wait_bounded(&full[s], static_cast<uint32_t>((seq / kStages) & 1), ctx)) return ~uint64_t{0};
      for (int d = 0; d < ndst; ++d) {
        cuda::ptx::cp_async_bulk(cuda::ptx::space_global, cuda::ptx::space_shared, dsts[d] + i * kStageBytes,
                                 stages + s * kStageBytes, chunk_size(i));
      }
      cuda::ptx::cp_async_bulk_commit_group();
      if (i + kStages - 1 < chunks) {
        cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<1>{});
        issue_load(i + kStages - 1);
      }
    }
    // All writes complete, then ordered before the generic-proxy flag store the caller makes.
    cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{});
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
    return phase_base + chunks;
  }
};

}  // namespace loom::kernels
