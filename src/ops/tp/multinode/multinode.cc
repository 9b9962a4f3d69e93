#include "ops/tp/multinode/multinode.h"

#include <string>

#include "ops/tp/tp_common.h"
#include "planner/tp_plan.h"
#include "runtime/communicator_impl.h"

namespace loom::ops::tp::multinode {

namespace kmn = kernels::tp::multinode;

kmn::Grid grid_of(const Communicator::Impl& impl) {
  kmn::Grid g;
  g.nodes = static_cast<uint32_t>(impl.topology.num_nodes);
  g.local = static_cast<uint32_t>(impl.topology.local_world_size);
  g.node = static_cast<uint32_t>(impl.topology.node);
  g.me = static_cast<uint32_t>(impl.topology.local_rank);
  return g;
}

Result<planner::MultiNodePlan> plan(Communicator::Impl& impl, OpId op, const TpGemmArgs& a, const TpGemmOptions& options) {
  LOOM_TRY(check_common(impl, op, a));
  if (!impl.network) {
    return Status::unsupported(std::string(planner::tp_op_name(op)) +
                               ": the multi-node path needs a communicator spanning several nodes");
  }
  planner::MultiNodeRequest r;
  r.op = op;
  r.m = a.m;
  r.n = a.n;
  r.k = a.k;
  r.dtype = a.dtype;
  r.b_layout = a.b_layout;
  r.grid = grid_of(impl);
  r.sm_count = impl.sm_count;
  r.plan_sm_count = impl.topology.min_sm_count;
  const NetComm window = impl.network->device_view();
  r.flag_base = window.launch_flag_base;
  r.flag_capacity = window.flag_count - window.launch_flag_base;
  r.gathered_a = a.gathered_a != nullptr;
  return planner::plan_multinode(r, options);
}

Result<TpCall> plan_call(Communicator::Impl& impl, OpId op, const TpGemmArgs& args, const TpGemmOptions& options) {
  TpCall call;
  LOOM_ASSIGN_OR_RETURN(call.multinode, plan(impl, op, args, options));
  const planner::MultiNodePlan& p = call.multinode;
  call.info.path = TpPath::kMultiNode;
  call.info.tile = p.tile;
  call.info.ctas = p.grid;
  call.info.comm_ctas = static_cast<int>(p.roles.rest_begin());
  call.info.workspace_bytes = p.workspace_bytes;
  call.info.source = options.tile != GemmTile::kAuto ? "options" : "fixed";
  return call;
}

uint32_t signature(OpId op, GemmTile tile, const kmn::Grid& g, std::initializer_list<int64_t> values) {
  const int world_code = static_cast<int>((0x4d4eu << 16) | ((static_cast<uint32_t>(g.nodes) & 0xFFu) << 8) |
                                          (static_cast<uint32_t>(g.local) & 0xFFu));
  return plan_signature(op, tile, world_code, values);
}

}  // namespace loom::ops::tp::multinode
