// moe_dispatch_gemm: moe_dispatch (dispatch.cuh) and the grouped GEMM of the local experts
// (grouped_gemm.cuh) as one persistent kernel; an expert's tiles start as soon as their receive
// rows have landed, while other rows are still being pushed.
//
// Roles (DispatchGemmRoleTable), every CTA of the GEMM engine's shape (Cfg::kThreads threads, its
// shared memory; one CTA per SM, all resident):
//   arrival  CTAs [0, arrival): moe_dispatch's arrival role (receive blocks, repeated rows copied,
//            ready[f] = e; none on one rank, where the pushing warps set ready[]), then the
//            compute role.
//   forward  several nodes, the next forward CTAs: moe_dispatch's forwarding role (the entries
//            other nodes sent this rank, pushed to their ranks here), then the compute role.
//   push     the next push CTAs: moe_dispatch's push role (every warp pushes tokens), then the
//            compute role.
//   compute  the rest, from the start: the GEMM engine's compute role with ArrivedGroupedTiles,
//            which gates every tile on ready[] of the receive blocks its stored rows cover.
// Tiles come from the MoE family's launch-wide queue (LaunchState::tile_queue, reset when the
// launch ends), so CTAs that join late take whatever is left. The tile table (expert, first row,
// row limit per tile row over this rank's receive rows) is written by the grouped GEMM's plan
// kernel just before, in stream order, from the routing's expert_offsets.
//
// Ordering: arrival stores ready[f] = e with release semantics after the block's rows (pushed by
// peers with system-scope release counters, copied locally) are in place; a tile's scheduling
// thread acquires every covering flag, then fences the generic proxy against the async proxy
// (TMA reads the rows next). A tile may load rows past its expert's end (the next expert's, maybe
// not landed yet, or rows past the kept ones): the GEMM never mixes rows, and those rows' results
// are not stored (the engine's row ranges), so the race reads values that are thrown away.
//
// Buffers: moe_dispatch's (recv_x, the MoE workspace's rows, arrival, ready) plus
//   weights  [El, N, K] or [El, K, N]  this rank's local experts (device memory of this GPU)
//   out      [C, N_out] rows in the receive layout; rows past the kept ones untouched
//   tiles    the MoE workspace's tile table (kernels/moe/layout.h), this rank's own copy
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/wait.cuh"
#include "kernels/frame/persistent.cuh"
#include "kernels/frame/role_table.h"
#include "kernels/gemm/compute_role.cuh"
#include "kernels/gemm/scheduler.cuh"
#include "kernels/moe/dispatch.cuh"
#include "kernels/moe/flags.h"
#include "kernels/moe/grouped_gemm.cuh"

namespace loom::kernels::moe {

enum class DispatchGemmRole : uint32_t {
  kArrival = 0,  // moe_dispatch's arrival role, then compute
  kForward = 1,  // several nodes: moe_dispatch's forwarding role, then compute
  kPush = 2,     // moe_dispatch's push role, then compute
  kCompute = 3,  // the grouped GEMM on tiles whose rows are ready
};
using DispatchGemmRoleTable = frame::RoleTable<DispatchGemmRole, DispatchGemmRole::kCompute>;

struct DispatchGemmParams {
  GroupedGemmKernelParams gemm;  // first: its tensor maps need 64-byte alignment. a = recv_x [C, K];
                                 // header / table: this rank's tile table; sched.queue: the tile queue
  DispatchParams dispatch;       // its `roles` is unused (the table below assigns them)
  DispatchGemmRoleTable roles;
};
static_assert(sizeof(DispatchGemmParams) <= 4096, "moe_dispatch_gemm's parameters must fit the classic 4 KiB limit");

// The grouped GEMM's tile policy with a gate: tile row m waits (bounded) until every receive
// block that holds one of its stored rows, [row_first, min(row_first + BLOCK_M, row_limit)), is
// ready. It runs on the producer's scheduling thread, which has few registers: it keeps only the
// launch's parameters (in the constant bank) and the epoch, and finds ready[] from them.
template <int kBlockM>
struct ArrivedGroupedTiles : GroupedTiles {
  const DispatchParams* dispatch;
  uint64_t epoch;

  __device__ bool gate(uint32_t m_block, const gemm::SchedulerParams& /*p*/, const WaitContext& ctx) const {
    const uint4 row = *reinterpret_cast<const uint4*>(table + m_block);  // expert, first row, row limit
    const uint32_t end = min(row.y + static_cast<uint32_t>(kBlockM), row.z);
    const DeviceComm& c = dispatch->comm;
    const uint64_t* ready = dispatch->ws.at<uint64_t>(c, c.local_rank, dispatch->ws.layout.ready);
    constexpr uint32_t kRows = MoeTunables::kArrivalRows;
    for (uint32_t f = row.y / kRows; f <= (end - 1) / kRows; ++f) {
      if (!wait_flag(ready + f, epoch, ctx, -1, kReadyFlag, f)) return false;
    }
    // The rows were written by generic stores (peers, the arrival role) and are read by TMA next.
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
    return true;
  }
};

// The dispatch roles of a fused kernel whose CTAs all compute afterwards (moe_dispatch_gemm,
// moe_layer), all threads of the CTA: a CTA of the table's kArrival role completes receive
// blocks, kForward (a table that has it; several nodes) forwards the entries other nodes sent,
// kPush pushes tokens (push_role); any other role has nothing to do here. kFreeBytes: the compute
// role's stage buffers from the aligned base of `smem`, which the roles use until the CTA
// computes. False after a failed wait (recorded): the CTA must not compute.
template <uint32_t kFreeBytes, class Role, Role kLast>
__device__ __forceinline__ bool run_dispatch_roles(const DispatchParams& d, const frame::RoleTable<Role, kLast>& roles,
                                                   const frame::LaunchFrame& f, uint8_t* smem) {
  const uint32_t index = roles.index_in_role(blockIdx.x);
  const Role role = roles.role_of(blockIdx.x);
  if (role == Role::kArrival) {
    // receive_blocks' shared word: the first word of the GEMM's stage buffers, free until this
    // CTA computes (then fenced against the TMA writes that reuse it).
    auto* pick = reinterpret_cast<volatile uint32_t*>(frame::aligned_smem(smem));
    const bool ok = receive_blocks(d, index, roles.count(Role::kArrival), f.epoch, f.ctx, pick);
    cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
    return ok;
  }
  if constexpr (requires { Role::kForward; }) {
    if (role == Role::kForward) return forward_role(d, index, roles.count(Role::kForward), f);
  }
  if (role == Role::kPush) {
    // push_role's sort: the start of the GEMM's stage buffers, free until this CTA computes.
    static_assert(sizeof(PushOrderSmem) <= kFreeBytes,
                  "the push role's sort must fit in the compute role's stage buffers, which are free until it runs");
    auto* sort = reinterpret_cast<PushOrderSmem*>(frame::aligned_smem(smem));
    const bool ok = push_role(d, index, roles.count(Role::kPush), sort, f.epoch, f.ctx);
    cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);  // the TMA loads that reuse it come after
    return cta_all(ok);
  }
  return true;
}

template <class Cfg, bool kBF16, bool kBNMajor, bool kGated>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    moe_dispatch_gemm_kernel(const __grid_constant__ DispatchGemmParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  using Tiles = ArrivedGroupedTiles<Cfg::kBlockM>;
  using Scheduler = gemm::TileScheduler<Tiles>;
  using Epilogue = GroupedEpilogue<Cfg::kBlockM, kGated>;
  using Role = gemm::ComputeRole<Cfg, kBF16, kBNMajor, Scheduler, Epilogue>;
  static_assert(Scheduler::kGroupedB && Scheduler::kRowRanges,
                "moe_dispatch_gemm's scheduler must hand out each tile's expert and row range");
  static_assert(Cfg::kThreads % 32 == 0, "the dispatch roles work in whole warps");
  const DispatchParams& d = p.dispatch;
  const DeviceComm& c = d.comm;
  const frame::LaunchFrame f = frame::LaunchFrame::enter(c, kDispatchGemmOp, moe_entry(c), d.signature);
  Role::init(smem);

  const DispatchGemmRoleTable& roles = p.roles;
  const bool compute = run_dispatch_roles<Cfg::kControlOffset>(d, roles, f, smem);
  if (compute) {
    gemm::SchedulerParams sched = p.gemm.sched;
    sched.m_blocks = p.gemm.header->tile_rows;  // written by the plan kernel just before, in stream order
    Tiles tiles{};
    tiles.table = p.gemm.table;
    tiles.expert_groups = p.gemm.expert_groups;
    tiles.dispatch = &d;
    tiles.epoch = f.epoch;
    Scheduler scheduler(sched, tiles);
    Epilogue epi(p.gemm.epi, &p.gemm.d, p.gemm.d_ptr, p.gemm.ldd_bytes);
    gemm::GemmOperands ops{&p.gemm.a, &p.gemm.b, p.gemm.m, p.gemm.n, p.gemm.k};
    ops.a_rows = &p.gemm.a_rows;
    (void)Role::run(smem, ops, scheduler, epi, roles.rest_index(blockIdx.x, gridDim.x), gridDim.x, f.ctx);
  }
  f.finish(d.state, c);
}

}  // namespace loom::kernels::moe
