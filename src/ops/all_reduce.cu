// Host launcher of all_reduce: validate -> plan -> launch (kernel: kernels/collectives/all_reduce.cuh).
#include "kernels/collectives/all_reduce.cuh"
#include "ops/collective_common.h"
#include "ops/launch/kernel_launch.h"
#include "ops/launch/queued_work.h"
#include "ops/launch/signature.h"
#include "runtime/cuda_check.h"

namespace loom {

namespace ops {

Status all_reduce_for(Communicator& comm, const void* send, void* recv, size_t count, DType dtype, cudaStream_t stream,
                  const CollectiveOptions& options, OpId label, uint32_t outer) {
  LOOM_ASSIGN_OR_RETURN(Communicator::Impl& impl, ops::collective_impl(comm, "all_reduce", count, dtype));
  LOOM_TRY(ops::check_no_bulk_engine("all_reduce", options));
  if (count == 0) return {};
  const uint64_t bytes = static_cast<uint64_t>(count) * dtype_size(dtype);
  LOOM_ASSIGN_OR_RETURN(uint64_t send_offset, impl.symmetric_offset(send, bytes, "all_reduce: send"));
  LOOM_ASSIGN_OR_RETURN(uint64_t recv_offset, impl.symmetric_offset(recv, bytes, "all_reduce: recv"));
  if (impl.topology.local_world_size == 1) return ops::single_rank_copy(send, recv, bytes, stream);
  const uint64_t per_rank = bytes / static_cast<uint64_t>(impl.topology.local_world_size);
  LOOM_ASSIGN_OR_RETURN(planner::CollectivePlan plan, ops::plan_for(impl, OpId::kAllReduce, per_rank, options, false));

  kernels::CollectiveArgs args = ops::collective_args(impl, label, send, recv, bytes);
  args.send_offset = send_offset;
  args.recv_offset = recv_offset;
  args.vectorizable = send_offset % 16 == 0 && recv_offset % 16 == 0;
  args.signature = collective_signature(label, outer, bytes, dtype, plan.num_ctas, static_cast<int>(plan.engine), send_offset,
                                        recv_offset);
  const size_t smem = sizeof(uint64_t) * static_cast<size_t>(impl.topology.local_world_size);
  return ops::dispatch_dtype(dtype, [&](auto element) -> Status {
    using T = decltype(element);
    return launch_kernel(&kernels::all_reduce_kernel<T>, static_cast<unsigned>(plan.num_ctas), kernels::ReduceConfig::kThreads, smem,
                         stream, args);
  });
}

}  // namespace ops

Status all_reduce(Communicator& comm, const void* send, void* recv, size_t count, DType dtype, cudaStream_t stream,
                  const CollectiveOptions& options) {
  return ops::noted(comm, ops::all_reduce_for(comm, send, recv, count, dtype, stream, options, OpId::kAllReduce), stream);
}

}  // namespace loom
