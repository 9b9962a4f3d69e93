// The tensor-parallel operators (ag_gemm, gemm_rs, gemm_ar) as the host sees each of them, one
// node or several: a compiled plan (shape and options; no buffers), its buffer checks and its
// launch. loom::ag_gemm / gemm_rs / gemm_ar and the public queries (loom/tensor_parallel.h:
// tp_plan, tp_can_implement, tp_workspace_bytes, tp_reserve_workspace) are one function each over
// them (tp_ops.cc).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string_view>

#include "loom/diagnostics.h"
#include "loom/status.h"
#include "loom/tensor_parallel.h"
#include "planner/multinode_plan.h"
#include "planner/tp_plan.h"
#include "runtime/communicator_impl.h"

namespace loom::ops::tp {

// What one call runs, decided once and alike on every rank from the same arguments.
struct TpCall {
  TpPlanInfo info;                    // what tp_plan() reports (path, tile, CTAs, workspace)
  planner::TpPlan plan;               // one node: the planner's choice
  planner::TailSplit split;           // fused: the tail split
  int64_t rows_per_flag = 0;          // fused ag_gemm: rows of a pushed chunk
  planner::MultiNodePlan multinode;   // several nodes
  TileTimelineRecord* timeline = nullptr;  // fused: TpGemmOptions::timeline (diagnostics)
};

struct TpOperator {
  OpId op;
  std::string_view family;  // whose workspace and launch state it uses (ops/launch/family_resources.h)
  Result<TpCall> (*plan)(Communicator::Impl& impl, const TpGemmArgs& args, const TpGemmOptions& options);
  Status (*check_buffers)(Communicator::Impl& impl, const TpGemmArgs& args);
  Status (*launch)(Communicator& comm, const TpCall& call, const TpGemmArgs& args, cudaStream_t stream);
};

// One NVLink domain (ag_gemm.cu, staged_reduce.cu) and several nodes (multinode/).
const TpOperator& ag_gemm_operator();
const TpOperator& gemm_rs_operator();
const TpOperator& gemm_ar_operator();
namespace multinode {
const TpOperator& ag_gemm_operator();
const TpOperator& gemm_rs_operator();
const TpOperator& gemm_ar_operator();
}  // namespace multinode

// The operator of `op` for this communicator (its node count chooses the family).
const TpOperator& operator_for(const Communicator::Impl& impl, TpOp op);

}  // namespace loom::ops::tp
