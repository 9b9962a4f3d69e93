// loom::ag_gemm / gemm_rs / gemm_ar and the public plan queries (loom/tensor_parallel.h): one
// function each over the operators of ops/tp/tp_operator.h — plan, check the buffers, launch,
// note the queued work.
#include <string>

#include "loom/tensor_parallel.h"
#include "ops/launch/family_resources.h"
#include "ops/launch/queued_work.h"
#include "ops/tp/tp_operator.h"
#include "planner/tp_plan.h"

namespace loom {
namespace ops::tp {

const TpOperator& operator_for(const Communicator::Impl& impl, TpOp op) {
  const bool nodes = impl.topology.num_nodes > 1;
  switch (op) {
    case TpOp::kAgGemm: return nodes ? multinode::ag_gemm_operator() : ag_gemm_operator();
    case TpOp::kGemmRs: return nodes ? multinode::gemm_rs_operator() : gemm_rs_operator();
    case TpOp::kGemmAr: break;
  }
  return nodes ? multinode::gemm_ar_operator() : gemm_ar_operator();
}

namespace {

Status run(Communicator& comm, TpOp op, const TpGemmArgs& args, cudaStream_t stream, const TpGemmOptions& options) {
  Communicator::Impl& impl = internal(comm);
  const TpOperator& o = operator_for(impl, op);
  LOOM_ASSIGN_OR_RETURN(const TpCall call, o.plan(impl, args, options));
  LOOM_TRY(o.check_buffers(impl, args));
  return noted(comm, o.launch(comm, call, args, stream), stream);
}

Status check_op(TpOp op) {
  if (op == TpOp::kAgGemm || op == TpOp::kGemmRs || op == TpOp::kGemmAr) return {};
  return Status::invalid_argument("tp_plan: unknown TpOp value " + std::to_string(static_cast<int>(op)));
}

}  // namespace
}  // namespace ops::tp

Status ag_gemm(Communicator& comm, const TpGemmArgs& args, cudaStream_t stream, const TpGemmOptions& options) {
  return ops::tp::run(comm, TpOp::kAgGemm, args, stream, options);
}

Status gemm_rs(Communicator& comm, const TpGemmArgs& args, cudaStream_t stream, const TpGemmOptions& options) {
  return ops::tp::run(comm, TpOp::kGemmRs, args, stream, options);
}

Status gemm_ar(Communicator& comm, const TpGemmArgs& args, cudaStream_t stream, const TpGemmOptions& options) {
  return ops::tp::run(comm, TpOp::kGemmAr, args, stream, options);
}

Result<TpPlanInfo> tp_plan(Communicator& comm, TpOp op, const TpGemmArgs& args, const TpGemmOptions& options) {
  LOOM_TRY(ops::tp::check_op(op));
  Communicator::Impl& impl = internal(comm);
  LOOM_ASSIGN_OR_RETURN(const ops::tp::TpCall call, ops::tp::operator_for(impl, op).plan(impl, args, options));
  return call.info;
}

Status tp_can_implement(Communicator& comm, TpOp op, const TpGemmArgs& args, const TpGemmOptions& options) {
  LOOM_TRY(ops::tp::check_op(op));
  Communicator::Impl& impl = internal(comm);
  const ops::tp::TpOperator& o = ops::tp::operator_for(impl, op);
  LOOM_TRY(o.plan(impl, args, options).status());
  return o.check_buffers(impl, args);
}

Result<size_t> tp_workspace_bytes(Communicator& comm, TpOp op, const TpGemmArgs& args, const TpGemmOptions& options) {
  LOOM_ASSIGN_OR_RETURN(const TpPlanInfo info, tp_plan(comm, op, args, options));
  return info.workspace_bytes;
}

Status tp_reserve_workspace(Communicator& comm, TpOp op, const TpGemmArgs& args, cudaStream_t stream,
                            const TpGemmOptions& options) {
  LOOM_TRY(ops::tp::check_op(op));
  Communicator::Impl& impl = internal(comm);
  const ops::tp::TpOperator& o = ops::tp::operator_for(impl, op);
  LOOM_ASSIGN_OR_RETURN(const ops::tp::TpCall call, o.plan(impl, args, options));
  if (call.info.workspace_bytes == 0) return {};
  const std::string name(planner::tp_op_name(o.op));
  return ops::family_workspace(impl, o.family, call.info.workspace_bytes, stream, name.c_str()).status();
}

}  // namespace loom
