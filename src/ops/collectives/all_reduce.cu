// Host launcher of all_reduce: validate -> plan -> launch (kernel: kernels/collectives/all_reduce.cuh).
#include "kernels/collectives/all_reduce.cuh"
#include "ops/collectives/common.h"
#include "ops/launch/kernel_launch.h"
#include "ops/launch/queued_work.h"
#include "ops/launch/signature.h"
#include "runtime/cuda_check.h"

namespace loom {

namespace ops {

Result<CollectiveCall> plan_all_reduce(Communicator& comm, const void* send, const void* recv, size_t count, DType dtype,
                                       const CollectiveOptions& options, OpId label, uint32_t outer) {
  LOOM_ASSIGN_OR_RETURN(Communicator::Impl& impl, ops::collective_impl(comm, "all_reduce", count, dtype));
  LOOM_TRY(ops::check_no_bulk_engine("all_reduce", options));
  if (count == 0) return CollectiveCall{};
  const uint64_t bytes = static_cast<uint64_t>(count) * dtype_size(dtype);
  LOOM_ASSIGN_OR_RETURN(uint64_t send_offset, impl.symmetric_offset(send, bytes, "all_reduce: send"));
  LOOM_ASSIGN_OR_RETURN(uint64_t recv_offset, impl.symmetric_offset(recv, bytes, "all_reduce: recv"));
  const uint64_t per_rank = bytes / static_cast<uint64_t>(impl.topology.local_world_size);
  CollectiveCall call;
  call.kind = CollectiveCall::Kind::kKernel;
  // Planned (the options checked) before the one-rank shortcut, so bad options fail at any world.
  LOOM_ASSIGN_OR_RETURN(call.plan, ops::plan_for(impl, OpId::kAllReduce, per_rank, options, false));
  if (impl.topology.local_world_size == 1) return ops::single_rank_copy(send, recv, bytes);
  call.args = ops::collective_args(impl, label, send, const_cast<void*>(recv), bytes);
  call.args.send_offset = send_offset;
  call.args.recv_offset = recv_offset;
  call.args.vectorizable = send_offset % 16 == 0 && recv_offset % 16 == 0;
  call.args.signature = collective_signature(label, outer, bytes, dtype, call.plan.num_ctas,
                                             static_cast<int>(call.plan.engine), send_offset, recv_offset);
  call.smem = sizeof(uint64_t) * static_cast<size_t>(impl.topology.local_world_size);
  return call;
}

Status all_reduce_for(Communicator& comm, const void* send, void* recv, size_t count, DType dtype, cudaStream_t stream,
                      const CollectiveOptions& options, OpId label, uint32_t outer) {
  LOOM_ASSIGN_OR_RETURN(const CollectiveCall call, plan_all_reduce(comm, send, recv, count, dtype, options, label, outer));
  return launch_collective(call, kernels::ReduceConfig::kThreads, stream, [&] {
    return reduction_kernel(dtype, [](auto element) { return &kernels::all_reduce_kernel<decltype(element)>; });
  });
}

}  // namespace ops

Status all_reduce(Communicator& comm, const void* send, void* recv, size_t count, DType dtype, cudaStream_t stream,
                  const CollectiveOptions& options) {
  return ops::noted(comm, ops::all_reduce_for(comm, send, recv, count, dtype, stream, options, OpId::kAllReduce), stream);
}

}  // namespace loom
