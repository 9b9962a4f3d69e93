// Host-side steps shared by the collective launchers: validate, plan, build kernel arguments.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>

#include "kernels/collectives/common.cuh"
#include "loom/collectives.h"
#include "ops/launch/kernel_launch.h"
#include "planner/collective_plan.h"
#include "runtime/communicator_impl.h"
#include "runtime/cuda_check.h"

namespace loom::ops {

// Checks that do not depend on the operator: usable communicator, single node, size limits.
inline Status check_collective_common(Communicator::Impl& impl, const char* op, size_t count, DType dtype) {
  LOOM_TRY(impl.check_usable());
  if (impl.topology.num_nodes > 1) {
    return Status::unsupported(std::string(op) + ": loom's collectives run within one NVLink domain; this job spans " +
                               std::to_string(impl.topology.num_nodes) + " nodes");
  }
  if (dtype != DType::kBF16 && dtype != DType::kF16 && dtype != DType::kF32) {
    return Status::invalid_argument(std::string(op) + ": unknown dtype " + std::to_string(static_cast<int>(dtype)));
  }
  const uint64_t bytes = static_cast<uint64_t>(count) * dtype_size(dtype);
  if (count != 0 && bytes / dtype_size(dtype) != count) {
    return Status::invalid_argument(std::string(op) + ": count overflows a 64-bit byte size");
  }
  return {};
}

// The communicator's internals for collective `op`, once check_collective_common has passed
// (its failures prefixed with `op`). Every collective launcher starts here.
inline Result<std::reference_wrapper<Communicator::Impl>> collective_impl(Communicator& comm, const char* op,
                                                                          size_t count, DType dtype) {
  Communicator::Impl& impl = internal(comm);
  LOOM_TRY_CTX(check_collective_common(impl, op, count, dtype), op);
  return std::ref(impl);
}

inline bool is_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// invalid_argument unless `options` leave the copy engine to loom or ask for vectors (only
// all_gather has a bulk-copy kernel).
inline Status check_no_bulk_engine(const char* op, const CollectiveOptions& options) {
  if (options.engine != CopyEngineChoice::kBulk) return {};
  return Status::invalid_argument(std::string(op) + ": the bulk copy engine applies to all_gather only");
}

// The bytes of all ranks' `per_rank` bytes together; invalid_argument when that overflows.
inline Result<uint64_t> bytes_of_all_ranks(const Communicator::Impl& impl, const char* op, uint64_t per_rank) {
  uint64_t total = 0;
  if (__builtin_mul_overflow(per_rank, static_cast<uint64_t>(impl.topology.local_world_size), &total)) {
    return Status::invalid_argument(std::string(op) + ": count x world size overflows a 64-bit byte size");
  }
  return total;
}

// The arguments every collective kernel takes: the communicator, the operator its errors name
// (`label`: the collective or the decomposed TP operator it serves), send, recv and `bytes`.
inline kernels::CollectiveArgs collective_args(const Communicator::Impl& impl, OpId label, const void* send, void* recv,
                                               uint64_t bytes) {
  kernels::CollectiveArgs args{};
  args.comm = impl.device_comm();
  args.op = static_cast<uint32_t>(label);
  args.send = static_cast<const char*>(send);
  args.recv = static_cast<char*>(recv);
  args.bytes = bytes;
  return args;
}

// What a collective call decided once every check passed (collective_plan reports it; the
// launchers launch it): nothing (count 0), a device copy (one rank), or a kernel.
struct CollectiveCall {
  enum class Kind : uint8_t { kNothing, kDeviceCopy, kKernel };
  Kind kind = Kind::kNothing;
  planner::CollectivePlan plan;
  kernels::CollectiveArgs args{};  // kKernel: the kernel's arguments; kDeviceCopy: send, recv, bytes
  size_t smem = 0;                 // dynamic shared memory of the kernel
};
// A collective over one rank moves its own data only: a device copy, or nothing in place (no
// kernel and no flags). Planned after the arguments were checked like any other call's.
inline CollectiveCall single_rank_copy(const void* send, const void* recv, uint64_t bytes) {
  CollectiveCall call;
  if (send == recv || bytes == 0) return call;
  call.kind = CollectiveCall::Kind::kDeviceCopy;
  call.args.send = static_cast<const char*>(send);
  call.args.recv = static_cast<char*>(const_cast<void*>(recv));
  call.args.bytes = bytes;
  return call;
}

// Launches a planned call: `kernel(dtype)` gives the kernel for a kKernel call.
template <typename KernelFor>
Status launch_collective(const CollectiveCall& call, unsigned threads, cudaStream_t stream, KernelFor&& kernel) {
  switch (call.kind) {
    case CollectiveCall::Kind::kNothing: return {};
    case CollectiveCall::Kind::kDeviceCopy:
      LOOM_CUDA_TRY(cudaMemcpyAsync(call.args.recv, call.args.send, call.args.bytes, cudaMemcpyDeviceToDevice, stream));
      return {};
    case CollectiveCall::Kind::kKernel:
      return launch_kernel(kernel(), static_cast<unsigned>(call.plan.num_ctas), threads, call.smem, stream, call.args);
  }
  return Status::internal("collective: unknown call kind");
}

inline Result<planner::CollectivePlan> plan_for(const Communicator::Impl& impl, OpId op, uint64_t bytes,
                                                const CollectiveOptions& options, bool bulk_eligible) {
  planner::CollectiveRequest request;
  request.op = op;
  request.bytes = bytes;
  request.local_world = impl.topology.local_world_size;
  request.sm_count = impl.topology.min_sm_count > 0 ? impl.topology.min_sm_count : impl.sm_count;
  request.max_chunks = impl.control.max_chunks;
  request.override_ctas = options.num_ctas > 0 ? options.num_ctas : impl.settings.collective_ctas;
  request.want_bulk = options.engine == CopyEngineChoice::kBulk;
  request.bulk_eligible = bulk_eligible;
  return planner::plan_collective(request);
}

// Checks and plans each collective (labels and `outer` as in the *_for launchers below).
Result<CollectiveCall> plan_all_gather(Communicator& comm, const void* send, const void* recv, size_t count, DType dtype,
                                       const CollectiveOptions& options, OpId label, uint32_t outer = 0);
Result<CollectiveCall> plan_reduce_scatter(Communicator& comm, const void* send, const void* recv, size_t recv_count,
                                           DType dtype, const CollectiveOptions& options, OpId label, uint32_t outer = 0);
Result<CollectiveCall> plan_all_reduce(Communicator& comm, const void* send, const void* recv, size_t count, DType dtype,
                                       const CollectiveOptions& options, OpId label, uint32_t outer = 0);

// The collectives with the operator they serve recorded in error records (a decomposed
// ag_gemm's all_gather times out as "ag_gemm"); the public functions pass their own OpId. `outer`:
// the served operator's own signature (ops/launch/signature.h), which joins the collective's in
// the entry check, so ranks that called different decomposed operators fail there.
Status all_gather_for(Communicator& comm, const void* send, void* recv, size_t count, DType dtype, cudaStream_t stream,
                      const CollectiveOptions& options, OpId label, uint32_t outer = 0);
Status reduce_scatter_for(Communicator& comm, const void* send, void* recv, size_t recv_count, DType dtype,
                          cudaStream_t stream, const CollectiveOptions& options, OpId label, uint32_t outer = 0);
Status all_reduce_for(Communicator& comm, const void* send, void* recv, size_t count, DType dtype, cudaStream_t stream,
                      const CollectiveOptions& options, OpId label, uint32_t outer = 0);

// `kernel_of(T{})` with T the CUDA element type of `dtype` (a reduction's kernel instance).
template <typename KernelOf>
auto reduction_kernel(DType dtype, KernelOf&& kernel_of) {
  switch (dtype) {
    case DType::kBF16: return kernel_of(__nv_bfloat16{});
    case DType::kF16: return kernel_of(__half{});
    case DType::kF32: break;
  }
  return kernel_of(float{});
}

}  // namespace loom::ops
