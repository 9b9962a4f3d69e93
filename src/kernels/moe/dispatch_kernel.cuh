// moe_dispatch's kernel: the roles of dispatch.cuh on the frame (a header of its own because
// moe_dispatch_gemm's instantiation files include the roles and must not define this kernel again).
#pragma once

#include <cstdint>

#include "kernels/frame/persistent.cuh"
#include "kernels/moe/dispatch.cuh"

namespace loom::kernels::moe {

__global__ void __launch_bounds__(MoeTunables::kThreads, 1) moe_dispatch_kernel(const __grid_constant__ DispatchParams p) {
  const DeviceComm& c = p.comm;
  const frame::LaunchFrame f = frame::LaunchFrame::enter(c, kDispatchOp, moe_entry(c), p.signature);
  const DispatchRoleTable& roles = p.roles;
  const uint32_t index = roles.index_in_role(blockIdx.x);
  switch (roles.role_of(blockIdx.x)) {
    case DispatchRole::kArrival: {
      __shared__ uint32_t pick;  // receive_blocks' choice, thread 0 to the CTA
      (void)receive_blocks(p, index, roles.count(DispatchRole::kArrival), f.epoch, f.ctx, &pick);
      break;
    }
    case DispatchRole::kForward:
      (void)forward_role(p, index, roles.count(DispatchRole::kForward), f);
      break;
    case DispatchRole::kPush:  // in token order: nothing reads the rows before the launch ends
      (void)push_role(p, index, roles.count(DispatchRole::kPush, gridDim.x), nullptr, f.epoch, f.ctx);
      break;
  }
  f.mark(LaunchPhase::kRolesDone);
  f.finish(p.state, c);
}

}  // namespace loom::kernels::moe
