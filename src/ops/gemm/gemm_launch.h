// The GEMM engine's internal launch interface (host side), used by loom::gemm, the GPU tests,
// loom-bench and the fused operators. loom::gemm is one GemmLaunch with the default scheduler
// (static raster) and epilogue (store to D); the tests and fused operators set the scheduler's
// gating/queue fields and the epilogue's destinations, op and signals.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/gemm/params.h"
#include "loom/gemm.h"
#include "loom/status.h"
#include "planner/gemm_heuristic.h"
#include "runtime/device_abi.h"

namespace loom::kernels::sm90 {
struct TmaDescriptor;
}
namespace loom::kernels::gemm {
struct GemmKernelParams;
}

namespace loom::ops {

struct GemmLaunch {
  GemmArgs args;                         // A, B, shape, dtypes; D is destination 0 by default
  GemmOptions options;                   // tile / num_ctas / group_m (0 = planner)
  kernels::gemm::SchedulerParams sched;  // queue, compute_limit, trace, order start, epoch;
                                         // m_rows, m_blocks, n_blocks and group_m are filled in
  kernels::gemm::EpilogueParams epi;     // op, num_dst, rows_per_dst, signal fields; out_dtype filled in
  void* dst[kernels::gemm::kMaxDst] = {};  // epi.num_dst destinations (null dst[0]: args.d), each
                                           // [rows, N] with leading dimension ldd (args.ldd or N)
  WaitParams wait{};                     // bounded waits: error record, abort words, timeout
};

// Validates, plans, encodes the tensor maps and launches. Rules beyond gemm_can_implement():
// num_dst in 1..8 with rows_per_dst > 0 when num_dst > 1 (a multiple of BLOCK_M, times
// chunk_m_blocks if set, when signalling); chunk_counters with chunk_m_blocks;
// wait.device_abort non-null.
Status launch_gemm(const GemmLaunch& launch, cudaStream_t stream);

// The plan launch_gemm would use (tile, grid, raster), for tests and the bench.
struct GemmLaunchPlan {
  GemmTile tile;
  int num_ctas;
  int group_m;
  int64_t m_blocks, n_blocks;
};
Result<GemmLaunchPlan> plan_gemm_launch(const GemmArgs& args, const GemmOptions& options);

// What launch_gemm would launch (M > 0): the standalone kernel's parameters and its plan, for a
// kernel that runs the engine with other policies (the GPU tests of the fused kernels' scheduling).
Status gemm_kernel_params(const GemmLaunch& launch, kernels::gemm::GemmKernelParams* params, GemmLaunchPlan* plan);

// Tensor maps for building fused kernels' parameters: A and B for `tile`, and an epilogue
// destination ([rows, n] row-major with leading dimension ld elements of `dtype`).
Status encode_gemm_operand_maps(const GemmArgs& args, GemmTile tile, kernels::sm90::TmaDescriptor* a,
                                kernels::sm90::TmaDescriptor* b);
// B of a grouped GEMM (kernels/gemm/operands.cuh): `groups` matrices shaped like args' B (its
// layout, N, K and leading dimension) one after the other from args.b, as one 3-D tensor map.
Status encode_gemm_grouped_b_map(const GemmArgs& args, int64_t groups, GemmTile tile, kernels::sm90::TmaDescriptor* b);
Status encode_gemm_output_map(void* ptr, int64_t rows, int64_t n, int64_t ld, DType dtype,
                              kernels::sm90::TmaDescriptor* out);
// A [rows, cols] row-major 16-bit matrix read in boxes of 64 columns x box_rows rows (128B
// swizzle), the geometry of the A operand: a fused kernel's second A source, or staged partial
// tiles that the compute role folds in (ComputeRole's Fold policy).
Status encode_gemm_rows_map(const void* ptr, int64_t rows, int64_t cols, int64_t ld, DType dtype, int box_rows,
                            kernels::sm90::TmaDescriptor* out);

// The current device's limits for the planner; unsupported unless it is a Hopper GPU (sm_90).
Result<planner::GemmDeviceLimits> gemm_device_limits();

// Per-launcher dispatch into the instantiation files (gemm_sm90_<tile>.cu).
namespace detail {
struct GemmKernelLaunch;
}

}  // namespace loom::ops
