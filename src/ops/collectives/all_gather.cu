// Host launcher of all_gather: validate -> plan -> launch (kernel: kernels/collectives/all_gather.cuh).
#include "kernels/collectives/all_gather.cuh"
#include "ops/collectives/common.h"
#include "ops/launch/kernel_launch.h"
#include "ops/launch/queued_work.h"
#include "ops/launch/signature.h"
#include "runtime/cuda_check.h"

namespace loom {

namespace ops {

Result<CollectiveCall> plan_all_gather(Communicator& comm, const void* send, const void* recv, size_t count, DType dtype,
                                       const CollectiveOptions& options, OpId label, uint32_t outer) {
  LOOM_ASSIGN_OR_RETURN(Communicator::Impl& impl, ops::collective_impl(comm, "all_gather", count, dtype));
  if (count == 0) return CollectiveCall{};
  const uint64_t shard = static_cast<uint64_t>(count) * dtype_size(dtype);
  LOOM_ASSIGN_OR_RETURN(const uint64_t recv_bytes, ops::bytes_of_all_ranks(impl, "all_gather", shard));
  LOOM_ASSIGN_OR_RETURN(uint64_t recv_offset, impl.symmetric_offset(recv, recv_bytes, "all_gather: recv"));
  LOOM_TRY_CTX(impl.check_local_device_buffer(send, shard, "send"), "all_gather");
  const bool bulk_eligible = ops::is_aligned16(send) && recv_offset % 16 == 0 && shard % 16 == 0;
  CollectiveCall call;
  call.kind = CollectiveCall::Kind::kKernel;
  // Planned (the options checked) before the one-rank shortcut, so bad options fail at any world.
  LOOM_ASSIGN_OR_RETURN(call.plan, ops::plan_for(impl, OpId::kAllGather, shard, options, bulk_eligible));
  if (impl.topology.local_world_size == 1) return ops::single_rank_copy(send, recv, shard);
  call.args = ops::collective_args(impl, label, send, const_cast<void*>(recv), shard);
  call.args.recv_offset = recv_offset;
  call.args.vectorizable = 1;  // vector_copy handles alignment itself
  call.args.signature = collective_signature(label, outer, shard, dtype, call.plan.num_ctas,
                                             static_cast<int>(call.plan.engine), 0, recv_offset);
  call.smem = call.plan.engine == planner::CopyEngine::kBulk ? kernels::AllGatherConfig::kBulkSmemBytes : 0;
  return call;
}

Status all_gather_for(Communicator& comm, const void* send, void* recv, size_t count, DType dtype, cudaStream_t stream,
                      const CollectiveOptions& options, OpId label, uint32_t outer) {
  LOOM_ASSIGN_OR_RETURN(const CollectiveCall call, plan_all_gather(comm, send, recv, count, dtype, options, label, outer));
  return launch_collective(call, kernels::AllGatherConfig::kThreads, stream, [&] {
    return call.plan.engine == planner::CopyEngine::kBulk ? &kernels::all_gather_kernel<kernels::CopyEngine::kBulk>
                                                          : &kernels::all_gather_kernel<kernels::CopyEngine::kVector>;
  });
}

}  // namespace ops

Status all_gather(Communicator& comm, const void* send, void* recv, size_t count, DType dtype, cudaStream_t stream,
                  const CollectiveOptions& options) {
  return ops::noted(comm, ops::all_gather_for(comm, send, recv, count, dtype, stream, options, OpId::kAllGather), stream);
}

}  // namespace loom
