// Hopper (sm_90a) primitives that CCCL's cuda::ptx does not provide: wgmma (issue, fences,
// shared-memory matrix descriptors), setmaxnreg, tensor-map prefetch, and the
// bounded mbarrier wait every loom pipeline uses. Everything else (TMA, mbarrier init/arrive,
// proxy fences, bulk groups) comes from <cuda/ptx>.
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/wait.cuh"
#include "kernels/common/tma_descriptor.h"
#include "kernels/common/wgmma_generated.cuh"

namespace loom::kernels::sm90 {

// ---- small helpers --------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// TmaDescriptor: an opaque CUtensorMap (kernels/common/tma_descriptor.h); device code does not
// include driver headers, and host code static_asserts that the two agree.

__device__ __forceinline__ void prefetch_tensormap(const TmaDescriptor* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// ---- register reallocation (warpgroup-wide; needs __launch_bounds__(threads, 1)) -----------
// .aligned: each warp executes it converged; the __syncwarp() first rejoins lanes that parted
// (a lane-0 wait, an elected thread's loop) — inline asm gives the compiler no reason to.

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg takes 24..256 in steps of 8");
  __syncwarp();
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg takes 24..256 in steps of 8");
  __syncwarp();
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// ---- wgmma -----------------------------------------------------------------------------------

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accesses to accumulator registers across wgmma issue/wait.
template <int kCount>
__device__ __forceinline__ void fence_operands(float (&d)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format"):
//   bits  0-13  start address >> 4      bits 16-29  leading-dimension byte offset >> 4
//   bits 32-45  stride-dimension byte offset >> 4      bits 49-51  base offset (0: atoms 1024-aligned)
//   bits 62-63  swizzle: 1 = 128-byte
// 128B-swizzle atoms are 8 rows x 128 bytes (1024 B). K-major operands: SBO = 1024 (next 8 rows),
// LBO unused (1). N-major B: LBO = byte distance between 64-element groups along N, SBO = 1024
// (next 8 rows along K).
__device__ __forceinline__ uint64_t make_smem_desc_sw128(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((smem_addr & 0x3FFFFu) >> 4);
  desc |= static_cast<uint64_t>((lbo_bytes & 0x3FFFFu) >> 4) << 16;
  desc |= static_cast<uint64_t>((sbo_bytes & 0x3FFFFu) >> 4) << 32;
  desc |= uint64_t{1} << 62;
  return desc;
}

template <int kCount>
__device__ __forceinline__ void fence_operands(uint32_t (&r)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// One m64nNk16 wgmma with A and B in shared memory, for the N that gen_wgmma.py generates
// (SS_NS there).
template <int kN, bool kBF16, int kTransB>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[kN / 2], uint64_t desc_a, uint64_t desc_b, uint32_t scale_d) {
  static_assert(wgmma_ss_generated(kN), "wgmma_m64k16: gen_wgmma.py does not generate this N (SS_NS)");
  wgmma_ss<kBF16, kTransB>(d, desc_a, desc_b, scale_d);
}

// One m64nNk16 wgmma with A from registers (the m64k16 fragment) and B in shared memory, for
// N = 64, 128, 256.
template <int kN, bool kBF16, int kTransB>
__device__ __forceinline__ void wgmma_m64k16_rs(float (&d)[kN / 2], const uint32_t (&a)[4], uint64_t desc_b,
                                                uint32_t scale_d) {
  static_assert(wgmma_rs_generated(kN), "wgmma_m64k16_rs: gen_wgmma.py does not generate this N (RS_NS)");
  wgmma_rs<kBF16, kTransB>(d, a, desc_b, scale_d);
}

// Named barriers (bar.sync ids 1..15; 0 is __syncthreads) between some warps of a CTA: `threads`
// threads take part, some syncing (waiting), some only arriving; whole warps call them.
// bar.sync / bar.arrive are .aligned (PTX: undefined unless every thread of the CTA reaches the
// same instruction; the barrier marks whole warps' arrival), and the compute role reaches its end
// barrier with the producer warps' elected lanes coming back from their loops at different times;
// so every call first rejoins the warp's lanes (__syncwarp).
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  __syncwarp();
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  __syncwarp();
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- mbarrier lifetime ------------------------------------------------------------------------

// Ends an mbarrier's life so its shared memory may be reused for other data (PTX requires it
// before repurposing the location; cuda::ptx does not wrap it). No phase may be pending.
__device__ __forceinline__ void mbarrier_inval(uint64_t* bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// ---- bounded mbarrier waits ------------------------------------------------------------------

// What an intra-CTA wait was for (BarrierWhat, runtime/device_abi.h), recorded in
// ErrorRecord::flag_index (flag_kind = kNone, waited_on = -1) when it gives up: what << 16 | index.
using loom::BarrierWhat;
__device__ __forceinline__ uint32_t barrier_what(BarrierWhat what, uint32_t index) {
  return (static_cast<uint32_t>(what) << 16) | (index & 0xFFFFu);
}

// Intra-CTA waits give the bounded flag waits (which carry the informative error) a head start:
// they time out a grace period after the launch deadline, and leave at once on an abort.
__device__ __forceinline__ uint64_t internal_deadline(const WaitContext& ctx) {
  const uint64_t grace = ctx.params.timeout_ns / 4 + 20'000'000ull;  // + 20 ms
  const uint64_t d = ctx.deadline_ns + grace;
  return d < ctx.deadline_ns ? ~uint64_t{0} : d;
}

// Barrier waits check their guard every kBarrierCheckInterval polls: they sit in the GEMM
// mainloop, where a check costs more than a poll.
constexpr uint32_t kBarrierCheckInterval = 128;

__device__ __forceinline__ bool mbarrier_wait_slow(uint64_t* bar, uint32_t parity, const WaitContext& ctx,
                                                      uint32_t what) {
  // The host's abort word only in a long wait (wait.cuh explains why).
  WaitGuard<kBarrierHostAbortCheckNs> guard(internal_deadline(ctx));
  for (uint32_t polls = 1;; ++polls) {
    if (cuda::ptx::mbarrier_try_wait_parity(bar, parity)) return true;
    if (polls % kBarrierCheckInterval == 0 && !guard.keep_waiting(ctx, -1, FlagKind::kNone, what, 0)) return false;
  }
}

// Waits until the phase of parity `parity` of `bar` has completed. Returns false (the failure
// recorded) on abort or timeout; the caller then leaves its loop.
__device__ __forceinline__ bool mbarrier_wait(uint64_t* bar, uint32_t parity, const WaitContext& ctx, uint32_t what) {
  if (cuda::ptx::mbarrier_try_wait_parity(bar, parity)) return true;
  return mbarrier_wait_slow(bar, parity, ctx, what);
}

}  // namespace loom::kernels::sm90
