// The warp roles inside a compute-role CTA (Cfg::kThreads threads: warpgroup 0 produces, the
// warpgroups after it consume), as enums, the way CUTLASS names them (WarpGroupRole,
// ProducerWarpRole): role code asks for a role, never for a thread index. Separate so that
// another kernel on the engine's pipeline (an attention kernel's loads and wgmma) splits its
// CTA the same way.
#pragma once

#include <cstdint>

namespace loom::kernels::gemm {

enum class WarpGroupRole : uint32_t {
  kProducer = 0,  // scheduling, TMA loads, signalling; registers drop to kProducerRegs
  kConsumer = 1,  // wgmma and the epilogue, one warpgroup per 64 tile rows
};

// The working warps of the producer warpgroup (warps 2 and 3 idle); each role's work is done by
// its warp's lane 0.
enum class ProducerWarpRole : uint32_t {
  kMainloop = 0,  // asks the scheduler for tiles, publishes them, issues every TMA load
  kSignaler = 1,  // signals finished tiles (the signal ring, signaler.cuh)
};

constexpr uint32_t kWarpGroupThreads = 128;

// The hardware named barriers the role uses (a kernel that embeds it uses no others with these
// ids): kCta is barrier 0, which __syncthreads also uses (all threads); kConsumers the consumer
// warpgroups' own.
enum class RoleBarrier : uint32_t {
  kCta = 0,
  kConsumers = 1,
};

// The role of warpgroup `warpgroup` (threadIdx.x / kWarpGroupThreads).
__device__ __forceinline__ WarpGroupRole warp_group_role(uint32_t warpgroup) {
  return warpgroup == 0 ? WarpGroupRole::kProducer : WarpGroupRole::kConsumer;
}
// A consumer warpgroup's index g among the consumers (it owns tile rows [64g, 64g + 64)).
__device__ __forceinline__ uint32_t consumer_index(uint32_t warpgroup) { return warpgroup - 1; }
// The thread (index in the CTA) that does producer warp `role`'s work: the warp's lane 0.
constexpr uint32_t elected_thread(ProducerWarpRole role) { return 32 * static_cast<uint32_t>(role); }

}  // namespace loom::kernels::gemm
