// The standalone persistent GEMM kernel: every CTA is a compute CTA running ComputeRole with the
// default TileScheduler and TileEpilogue (both configured at run time). Grid = number of CTAs
// the planner chose (SM count by default), Cfg::kThreads threads, Cfg::kSmemBytes of dynamic
// shared memory.
#pragma once

#include <cstdint>

#include "kernels/comm/wait.cuh"
#include "kernels/common/sm90.cuh"
#include "kernels/gemm/compute_role.cuh"
#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/params.h"
#include "kernels/gemm/scheduler.cuh"
#include "runtime/device_abi.h"

namespace loom::kernels::gemm {

// Kernel parameters (about 1.6 KB, passed by value as a __grid_constant__ so that the tensor
// maps have a stable address TMA can read).
struct GemmKernelParams {
  sm90::TmaDescriptor a;
  sm90::TmaDescriptor b;
  sm90::TmaDescriptor dst[kMaxDst];
  uint32_t m, n, k;
  SchedulerParams sched;
  EpilogueParams epi;
  WaitParams wait;
  TileTimelineRecord* timeline;  // optional (diagnostics), one record per tile
};

template <class Cfg, bool kBF16, bool kBNMajor, bool kManageRegisters = Cfg::kSetMaxNReg>
using StandaloneRole =
    ComputeRole<Cfg, kBF16, kBNMajor, TileScheduler<>, TileEpilogue<Cfg::kBlockM>, kManageRegisters>;

template <class Cfg, bool kBF16, bool kBNMajor>
__global__ void __launch_bounds__(Cfg::kThreads, 1) sm90_gemm_kernel(const __grid_constant__ GemmKernelParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  using Role = StandaloneRole<Cfg, kBF16, kBNMajor>;
  const WaitContext ctx = WaitContext::start(p.wait, OpId::kGemm, p.sched.epoch);
  Role::init(smem);
  TileScheduler<> sched(p.sched);
  TileEpilogue<Cfg::kBlockM> epi(p.epi, p.dst);
  const GemmOperands ops{&p.a, &p.b, p.m, p.n, p.k, nullptr, 0, 0, p.timeline};
  (void)Role::run(smem, ops, sched, epi, blockIdx.x, gridDim.x, ctx);
}

}  // namespace loom::kernels::gemm
