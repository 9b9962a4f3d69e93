// The frame of the multi-node operators' persistent kernels (multinode_ag_gemm.cuh,
// multinode_reduce.cuh, multinode_transfer.cuh): named roles and their table, the TMA copier the
// data-moving roles use, the end of a launch, and the tunables.
//
// One launch, on every rank (n, l), with launch epoch e (read on the device, CUDA-graph safe):
//   1. every CTA stores its NVLink entry word (e << 16 | signature) into every local peer's
//      network window (kernels/comm/net.cuh); the network-send CTA announces the entry to the
//      network peers that write into this rank;
//   2. before its first write into a peer (NVLink or network) a CTA waits, bounded, for that
//      peer's entry of epoch e with the same signature;
//   3. roles work; every wait is bounded; a CTA that fails skips to the end;
//   4. every CTA counts itself out: the last one zeroes the tile queue, then finish_launch
//      advances the epoch.
// Data only moves by push, and every write into a rank is followed by a flag that rank waits for
// before its launch ends, so no exit handshake is needed.
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/copy.cuh"  // mbarrier_wait_bounded
#include "kernels/comm/epoch.cuh"
#include "kernels/comm/net.cuh"
#include "kernels/comm/signals.cuh"
#include "kernels/comm/wait.cuh"
#include "kernels/common/sm90.cuh"
#include "kernels/tp/multinode_layout.h"
#include "runtime/device_abi.h"

namespace loom::kernels::tp::mn {

struct MnTunables {
  // GPUs per node a multi-node kernel addresses over NVLink (per-local-rank tensor maps live in
  // the kernel parameters); L itself is a run-time value.
  static constexpr int kMaxLocalWorld = 8;
  // The data-moving roles copy through a ring of TMA bulk loads and stores driven by one thread:
  // kCopyStages pieces of kCopyStageBytes in flight (128 KiB), in the compute role's stage
  // buffers, which are free until the CTA joins the compute role.
  static constexpr int kCopyStages = 8;
  static constexpr uint32_t kCopyStageBytes = 16 * 1024;
  // CTAs of the roles that exist only with L > 1 (the network rate is ~1/8 of NVLink's, so a few
  // CTAs replicate what arrives to L - 1 peers).
  static constexpr uint32_t kMaxNetRecvCtas = 4;
  static constexpr uint32_t kNvlinkCtas = 2;
};

// Roles a CTA takes, from the role table (never from bare index arithmetic).
enum class MultiNodeRole : uint32_t {
  kNetSend = 0,  // pushes network commands (own data, forwards, reduced partials); entry announcer
  kNetRecv = 1,  // waits for network arrivals and replicates them to the local peers over NVLink
  kNvlink = 2,   // pushes this rank's own data to the local peers over NVLink
  kCompute = 3,  // the GEMM engine's compute role on tiles from the launch's queue
};

// CTAs [0, net_send) send, then [.., + net_recv) receive, then [.., + nvlink) NVLink, the rest
// compute. The first CTAs are dispatched first: the network roles start at once even on a GPU
// shared with other work. Roles other than kNetSend join the compute role when their items are
// done (ag_gemm); the reduce kernels' kNetSend works for the whole launch.
struct MultiNodeRoleTable {
  uint32_t net_send = 0;
  uint32_t net_recv = 0;
  uint32_t nvlink = 0;

  LOOM_HOST_DEVICE uint32_t first_compute() const { return net_send + net_recv + nvlink; }
  LOOM_HOST_DEVICE MultiNodeRole role_of(uint32_t cta) const {
    if (cta < net_send) return MultiNodeRole::kNetSend;
    if (cta < net_send + net_recv) return MultiNodeRole::kNetRecv;
    if (cta < first_compute()) return MultiNodeRole::kNvlink;
    return MultiNodeRole::kCompute;
  }
  // Index of `cta` among the CTAs of its role.
  LOOM_HOST_DEVICE uint32_t index_in_role(uint32_t cta) const {
    if (cta < net_send) return cta;
    if (cta < net_send + net_recv) return cta - net_send;
    if (cta < first_compute()) return cta - net_send - net_recv;
    return cta - first_compute();
  }
  LOOM_HOST_DEVICE uint32_t count(MultiNodeRole role) const {
    switch (role) {
      case MultiNodeRole::kNetSend: return net_send;
      case MultiNodeRole::kNetRecv: return net_recv;
      case MultiNodeRole::kNvlink: return nvlink;
      case MultiNodeRole::kCompute: break;
    }
    return 0;
  }
};

// The 1024-byte aligned base of the dynamic shared memory, as the compute role aligns it.
__device__ __forceinline__ uint8_t* mn_aligned_smem(uint8_t* raw) {
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
}

// Copies one source range to up to kMaxLocalWorld destinations with the TMA bulk engine, driven
// by one thread. Shared memory (the caller's, 1024-aligned):
//   ring[kCopyStages][kCopyStageBytes]   pieces in flight
//   full[kCopyStages]                    mbarriers (8 B each)
// Pieces of all copies form one sequence (issued / landed count them): piece q lands in stage
// q % kStages, whose barrier completes phase q / kStages. Loads run kStages - 1 pieces ahead of
// the stores; the stores of a piece to every destination form one bulk group, and the stage of
// piece q - 1 is reloaded once group q - 1 has been read (wait_group.read 1).
struct MnCopier {
  static constexpr int kStages = MnTunables::kCopyStages;
  static constexpr uint32_t kStageBytes = MnTunables::kCopyStageBytes;
  static constexpr uint32_t kSmemBytes = kStages * kStageBytes + kStages * 8;
  static_assert(kStages >= 2, "the copier overlaps loads and stores: at least two stages");
  static_assert(kStageBytes % 16 == 0, "bulk copies move multiples of 16 bytes");

  uint8_t* ring;
  uint64_t* full;
  uint64_t issued = 0;  // pieces whose load was issued
  uint64_t landed = 0;  // pieces whose load was waited for

  __device__ explicit MnCopier(uint8_t* base) : ring(base), full(reinterpret_cast<uint64_t*>(base + kStages * kStageBytes)) {}

  __device__ void init() const {
    for (int s = 0; s < kStages; ++s) cuda::ptx::mbarrier_init(&full[s], 1);
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
  }

  // src and every destination 16-byte aligned, bytes a multiple of 16. On return (true) every
  // store has completed and is ordered before the caller's later generic-proxy stores (flags);
  // false after a failed (recorded) wait: call drain() before the shared memory is reused.
  __device__ bool copy(char* const* dsts, int ndst, const char* src, uint64_t bytes, const WaitContext& ctx) {
    const uint64_t pieces = (bytes + kStageBytes - 1) / kStageBytes;
    auto size_of = [&](uint64_t i) -> uint32_t {
      const uint64_t left = bytes - i * kStageBytes;
      return static_cast<uint32_t>(left < kStageBytes ? left : kStageBytes);
    };
    auto load = [&](uint64_t i) {
      const uint32_t s = static_cast<uint32_t>(issued % kStages);
      const uint32_t size = size_of(i);
      cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                           &full[s], size);
      cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, ring + s * kStageBytes,
                               src + i * kStageBytes, size, &full[s]);
      ++issued;
    };
    uint64_t next = 0;
    while (next < pieces && next < static_cast<uint64_t>(kStages - 1)) load(next++);
    for (uint64_t i = 0; i < pieces; ++i) {
      const uint32_t s = static_cast<uint32_t>(landed % kStages);
      if (!mbarrier_wait_bounded(&full[s], static_cast<uint32_t>((landed / kStages) & 1), ctx)) return false;
      ++landed;
      for (int d = 0; d < ndst; ++d) {
        cuda::ptx::cp_async_bulk(cuda::ptx::space_global, cuda::ptx::space_shared, dsts[d] + i * kStageBytes,
                                 ring + s * kStageBytes, size_of(i));
      }
      cuda::ptx::cp_async_bulk_commit_group();
      if (next < pieces) {
        cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<1>{});
        load(next++);
      }
    }
    cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{});
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
    return true;
  }

  // After a failure: loads already issued must land (their source is this GPU's memory, so this
  // is short; bounded anyway) and stores complete before the ring is reused or the CTA exits.
  __device__ void drain() {
    const uint64_t give_up = global_timer_ns() + 100'000'000ull;  // 100 ms: a local load that never lands is a bug
    for (; landed < issued; ++landed) {
      const uint32_t s = static_cast<uint32_t>(landed % kStages);
      const uint32_t parity = static_cast<uint32_t>((landed / kStages) & 1);
      while (!cuda::ptx::mbarrier_try_wait_parity(&full[s], parity) && global_timer_ns() < give_up) {
      }
    }
    cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{});
  }

  __device__ void invalidate() const {
    for (int s = 0; s < kStages; ++s) sm90::mbarrier_inval(&full[s]);
  }
};

// One thread: copies [src, src + bytes) to heap offset `offset` of every local peer through
// `copier` — waiting, the first time for each peer q (bit q of `entered`), until it entered this
// launch with the same plan — then sets word `flag` of each peer's network window to this
// launch's epoch, after the data. False after a failed (recorded) wait.
__device__ __forceinline__ bool mn_replicate_to_local_peers(const DeviceComm& c, uint32_t signature, uint64_t offset,
                                                            const char* src, uint64_t bytes, uint32_t flag,
                                                            uint32_t& entered, MnCopier& copier, const WaitContext& ctx) {
  char* dsts[MnTunables::kMaxLocalWorld];
  int ndst = 0;
  for (int q = 0; q < c.local_world; ++q) {
    if (q == c.local_rank) continue;
    if ((entered & (1u << q)) == 0) {
      if (!mn_wait_nvlink_entry(c, q, ctx.epoch, signature, ctx)) return false;
      entered |= 1u << q;
    }
    dsts[ndst++] = reinterpret_cast<char*>(c.peer_heap_bases[q] + offset);
  }
  if (!copier.copy(dsts, ndst, src, bytes, ctx)) return false;
  __threadfence_system();
  for (int q = 0; q < c.local_world; ++q) {
    if (q != c.local_rank) flag_store_release(net_word_at(c, q, flag), ctx.epoch);
  }
  return true;
}

// Runs `work(copier)` on thread 0 with a copier in the stage area of the compute role (all
// threads call it); returns work's answer to every thread. Afterwards the stage area is free for
// the compute role again (barriers invalidated, generic writes fenced against TMA's).
template <class Cfg, class Work>
__device__ bool mn_thread0_with_copier(uint8_t* smem_raw, Work&& work) {
  static_assert(MnCopier::kSmemBytes + 16 <= Cfg::kEpiOffset,
                "the copier's ring must fit in the compute role's stage buffers, which are free until run()");
  uint8_t* base = mn_aligned_smem(smem_raw);
  volatile int* ok_word = reinterpret_cast<volatile int*>(base + MnCopier::kSmemBytes);
  if (threadIdx.x == 0) {
    MnCopier copier(base);
    copier.init();
    const bool ok = work(copier);
    if (!ok) copier.drain();
    copier.invalidate();
    *ok_word = ok ? 1 : 0;
    // The compute role's TMA loads (async proxy) overwrite what this thread wrote here.
    cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
  }
  __syncthreads();
  const bool ok = *ok_word != 0;
  __syncthreads();  // the compute role's loads may overwrite the word next
  return ok;
}

// Raster position `within` of a block of `m_blocks` tile rows x `n_blocks` tile columns, in
// groups of `group_m` tile rows (dividing m_blocks), columns fastest within a group's rows
// (the GEMM engine's L2-friendly order).
__device__ __forceinline__ void raster_in_block(uint32_t within, uint32_t m_blocks, uint32_t n_blocks, uint32_t group_m,
                                                uint32_t& m_in, uint32_t& n_block) {
  const uint32_t g = group_m == 0 ? 1u : group_m;
  const uint32_t per_group = g * n_blocks;
  const uint32_t group = within / per_group;
  const uint32_t local = within - group * per_group;
  const uint32_t rows = min(m_blocks - group * g, g);
  m_in = group * g + local % rows;
  n_block = local / rows;
}

}  // namespace loom::kernels::tp::mn
