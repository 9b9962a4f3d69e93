// The collectives' plan and can_implement queries: the launchers' own checks and plan, nothing
// launched (ops/collectives/<op>.cu).
#include <string>

#include "loom/collectives.h"
#include "ops/collectives/common.h"

namespace loom {

namespace {

Result<ops::CollectiveCall> plan_call(Communicator& comm, CollectiveOp op, const void* send, const void* recv,
                                      size_t count, DType dtype, const CollectiveOptions& options) {
  switch (op) {
    case CollectiveOp::kAllGather: return ops::plan_all_gather(comm, send, recv, count, dtype, options, OpId::kAllGather);
    case CollectiveOp::kReduceScatter:
      return ops::plan_reduce_scatter(comm, send, recv, count, dtype, options, OpId::kReduceScatter);
    case CollectiveOp::kAllReduce: return ops::plan_all_reduce(comm, send, recv, count, dtype, options, OpId::kAllReduce);
  }
  return Status::invalid_argument("collective_plan: unknown collective " + std::to_string(static_cast<int>(op)));
}

}  // namespace

Result<CollectivePlanInfo> collective_plan(Communicator& comm, CollectiveOp op, const void* send, const void* recv,
                                           size_t count, DType dtype, const CollectiveOptions& options) {
  LOOM_ASSIGN_OR_RETURN(const ops::CollectiveCall call, plan_call(comm, op, send, recv, count, dtype, options));
  CollectivePlanInfo info;
  info.device_copy = call.kind == ops::CollectiveCall::Kind::kDeviceCopy;
  if (call.kind == ops::CollectiveCall::Kind::kKernel) {
    info.num_ctas = call.plan.num_ctas;
    info.engine = call.plan.engine == planner::CopyEngine::kBulk ? CopyEngineChoice::kBulk : CopyEngineChoice::kVector;
  }
  return info;
}

Status collective_can_implement(Communicator& comm, CollectiveOp op, const void* send, const void* recv, size_t count,
                                DType dtype, const CollectiveOptions& options) {
  return collective_plan(comm, op, send, recv, count, dtype, options).status();
}

}  // namespace loom
