// The multi-node gemm_rs and gemm_ar (kernel: kernels/tp/multinode/sm90_reduce.cuh): buffer
// checks and launch, the two operators alike (their kernels: gemm_rs.cu, gemm_ar.cu).
#include <cuda_runtime_api.h>

#include <string>

#include "core/log.h"
#include "ops/gemm/gemm_launch.h"
#include "ops/launch/family_resources.h"
#include "ops/launch/kernel_launch.h"
#include "ops/tp/multinode/multinode.h"
#include "ops/tp/multinode/reduce.h"
#include "ops/tp/tp_common.h"
#include "runtime/cuda_check.h"

namespace loom::ops::tp::multinode {
namespace {

namespace kmn = kernels::tp::multinode;

template <bool kAllReduce>
constexpr OpId kOp = kAllReduce ? OpId::kGemmAr : OpId::kGemmRs;

template <bool kAllReduce>
Result<TpCall> plan_reduce(Communicator::Impl& impl, const TpGemmArgs& args, const TpGemmOptions& options) {
  return plan_call(impl, kOp<kAllReduce>, args, options);
}

template <bool kAllReduce>
Status check_buffers(Communicator::Impl& impl, const TpGemmArgs& a) {
  return check_reduce_buffers(impl, kOp<kAllReduce>, a, kAllReduce ? a.m : a.m / impl.topology.world_size);
}

template <bool kAllReduce>
Status launch(Communicator& comm, const TpCall& call, const TpGemmArgs& a, cudaStream_t stream) {
  Communicator::Impl& impl = internal(comm);
  const std::string name(planner::tp_op_name(kOp<kAllReduce>));
  LOOM_TRY(load_kernels());
  const planner::MultiNodePlan& plan = call.multinode;
  const kmn::ReduceLayout& layout = plan.reduce;
  const kmn::Grid g = layout.g;
  LOOM_ASSIGN_OR_RETURN(void* ws, family_workspace(impl, kFamily, plan.workspace_bytes, stream, name.c_str()));
  const uint64_t row_bytes = static_cast<uint64_t>(a.n) * dtype_size(a.dtype);
  const GemmTileInfo info = gemm_tile_info(plan.tile);
  char* fold = static_cast<char*>(ws);
  char* send = fold + plan.fold_bytes;
  const uint64_t fold_offset = impl.heap->offset_of(fold);
  const uint64_t out_offset = kAllReduce ? impl.heap->offset_of(a.out) : 0;

  kmn::ReduceParams p{};
  LOOM_TRY(encode_gemm_operand_maps(local_gemm(a.a, a.b, a.out, a.m, a), plan.tile, &p.a, &p.b));
  LOOM_TRY(encode_gemm_rows_map(fold, layout.fold_rows(), a.n, a.n, a.dtype, info.block_m, &p.fold_src));
  LOOM_TRY(encode_gemm_output_map(send, layout.send_rows(), a.n, a.n, a.dtype, &p.send));
  if (kAllReduce) {
    for (uint32_t q = 0; q < g.local; ++q) {
      void* out_q = static_cast<char*>(impl.heap->peer_base(static_cast<int>(q))) + out_offset;
      LOOM_TRY(encode_gemm_output_map(out_q, a.m, a.n, a.n, a.dtype, &p.out[q]));
    }
  } else {
    LOOM_TRY(encode_gemm_output_map(a.out, layout.rows_per_block, a.n, a.n, a.dtype, &p.out[0]));
  }
  for (uint32_t q = 0; q < g.local; ++q) {
    if (q == g.me) continue;
    void* fold_q = static_cast<char*>(impl.heap->peer_base(static_cast<int>(q))) + fold_offset;
    LOOM_TRY(encode_gemm_output_map(fold_q, layout.fold_rows(), a.n, a.n, a.dtype, &p.stage_to[q]));
  }
  p.comm = impl.device_comm();
  LOOM_ASSIGN_OR_RETURN(p.state, family_launch_state(impl, kFamily));
  p.m = static_cast<uint32_t>(a.m);
  p.n = static_cast<uint32_t>(a.n);
  p.k = static_cast<uint32_t>(a.k);
  p.ramp_m = plan.ramp_m;
  p.group_m = plan.group_m;
  p.out_dtype = static_cast<uint32_t>(a.dtype);
  p.layout = layout;
  p.fold_offset = fold_offset;
  p.send_offset = impl.heap->offset_of(send);
  p.out_offset = out_offset;
  p.row_bytes = row_bytes;
  p.roles = plan.roles;
  // Heap offsets are part of the plan: peers write into this rank's fold source (and gemm_ar's
  // out) by their own offsets. K_r may differ between ranks and is not included.
  p.signature = signature(kOp<kAllReduce>, plan.tile, g,
                          {a.m, a.n, static_cast<int64_t>(a.dtype), static_cast<int64_t>(layout.rows_per_chunk),
                           static_cast<int64_t>(fold_offset), static_cast<int64_t>(out_offset)});
  // Zero rows (L > 1): the network sources of folds of other nodes' blocks. Stream-ordered
  // before the kernel; nobody else writes them (the workspace may have held other data before).
  if (g.local > 1) {
    LOOM_CUDA_TRY(cudaMemsetAsync(fold + static_cast<size_t>(layout.zero_row()) * row_bytes, 0, kmn::kBlockM * row_bytes, stream));
  }
  LOOM_DEBUG("%s multi-node M=%lld N=%lld K=%lld on %u x %u: tile %s, %d CTAs (%u send, %u receive), %u rows per chunk, "
             "fold rows %u",
             name.c_str(), static_cast<long long>(a.m), static_cast<long long>(a.n), static_cast<long long>(a.k), g.nodes,
             g.local, std::string(gemm_tile_name(plan.tile)).c_str(), plan.grid, plan.roles.count(kmn::CtaRole::kNetSend),
             plan.roles.count(kmn::CtaRole::kNetRecv), layout.rows_per_chunk, layout.fold_rows());
  LOOM_ASSIGN_OR_RETURN(const ReduceKernel kernel, reduce_kernel<kAllReduce>(plan.tile, a.dtype, a.b_layout));
  return launch_kernel(kernel.fn, static_cast<unsigned>(plan.grid), kernel.threads, kernel.smem_bytes, stream, p);
}

template <bool kAllReduce>
constexpr TpOperator kOperator{kOp<kAllReduce>, kFamily, plan_reduce<kAllReduce>, check_buffers<kAllReduce>, launch<kAllReduce>};

}  // namespace

const TpOperator& gemm_rs_operator() { return kOperator<false>; }
const TpOperator& gemm_ar_operator() { return kOperator<true>; }

}  // namespace loom::ops::tp::multinode
