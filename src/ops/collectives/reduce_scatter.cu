// Host launcher of reduce_scatter: validate -> plan -> launch (kernel: kernels/collectives/reduce_scatter.cuh).
#include "kernels/collectives/reduce_scatter.cuh"
#include "ops/collectives/common.h"
#include "ops/launch/kernel_launch.h"
#include "ops/launch/queued_work.h"
#include "ops/launch/signature.h"
#include "runtime/cuda_check.h"

namespace loom {

namespace ops {

Result<CollectiveCall> plan_reduce_scatter(Communicator& comm, const void* send, const void* recv, size_t recv_count,
                                           DType dtype, const CollectiveOptions& options, OpId label, uint32_t outer) {
  LOOM_ASSIGN_OR_RETURN(Communicator::Impl& impl, ops::collective_impl(comm, "reduce_scatter", recv_count, dtype));
  LOOM_TRY(ops::check_no_bulk_engine("reduce_scatter", options));
  if (recv_count == 0) return CollectiveCall{};
  const uint64_t chunk = static_cast<uint64_t>(recv_count) * dtype_size(dtype);
  const uint64_t world = static_cast<uint64_t>(impl.topology.local_world_size);
  LOOM_ASSIGN_OR_RETURN(const uint64_t send_bytes, ops::bytes_of_all_ranks(impl, "reduce_scatter", chunk));
  LOOM_ASSIGN_OR_RETURN(uint64_t send_offset, impl.symmetric_offset(send, send_bytes, "reduce_scatter: send"));
  LOOM_TRY_CTX(impl.check_local_device_buffer(recv, chunk, "recv"), "reduce_scatter");
  CollectiveCall call;
  call.kind = CollectiveCall::Kind::kKernel;
  // Planned (the options checked) before the one-rank shortcut, so bad options fail at any world.
  LOOM_ASSIGN_OR_RETURN(call.plan, ops::plan_for(impl, OpId::kReduceScatter, chunk, options, false));
  if (world == 1) return ops::single_rank_copy(send, recv, chunk);
  call.args = ops::collective_args(impl, label, send, const_cast<void*>(recv), chunk);
  call.args.send_offset = send_offset;
  // Vectors need every rank's chunk start (send_offset + r * chunk) and recv 16-byte aligned.
  call.args.vectorizable = send_offset % 16 == 0 && chunk % 16 == 0 && ops::is_aligned16(recv);
  call.args.signature = collective_signature(label, outer, chunk, dtype, call.plan.num_ctas,
                                             static_cast<int>(call.plan.engine), send_offset, 0);
  call.smem = sizeof(uint64_t) * world;
  return call;
}

Status reduce_scatter_for(Communicator& comm, const void* send, void* recv, size_t recv_count, DType dtype,
                          cudaStream_t stream, const CollectiveOptions& options, OpId label, uint32_t outer) {
  LOOM_ASSIGN_OR_RETURN(const CollectiveCall call,
                        plan_reduce_scatter(comm, send, recv, recv_count, dtype, options, label, outer));
  return launch_collective(call, kernels::ReduceConfig::kThreads, stream, [&] {
    return reduction_kernel(dtype, [](auto element) { return &kernels::reduce_scatter_kernel<decltype(element)>; });
  });
}

}  // namespace ops

Status reduce_scatter(Communicator& comm, const void* send, void* recv, size_t recv_count, DType dtype,
                      cudaStream_t stream, const CollectiveOptions& options) {
  return ops::noted(comm, ops::reduce_scatter_for(comm, send, recv, recv_count, dtype, stream, options, OpId::kReduceScatter),
                    stream);
}

}  // namespace loom
