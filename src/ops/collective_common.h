// Host-side steps shared by the collective launchers: validate, plan, build kernel arguments.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>

#include "kernels/collectives/common.cuh"
#include "loom/collectives.h"
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

// A collective over one rank moves its own data only: a device copy, or nothing in place (no
// kernel and no flags). Called after the arguments were checked like any other call's.
inline Status single_rank_copy(const void* send, void* recv, uint64_t bytes, cudaStream_t stream) {
  if (send == recv || bytes == 0) return {};
  LOOM_CUDA_TRY(cudaMemcpyAsync(recv, send, bytes, cudaMemcpyDeviceToDevice, stream));
  return {};
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

// Runs `launch` with T = the CUDA element type of `dtype`.
template <typename Fn>
Status dispatch_dtype(DType dtype, Fn&& launch) {
  switch (dtype) {
    case DType::kBF16: return launch(__nv_bfloat16{});
    case DType::kF16: return launch(__half{});
    case DType::kF32: return launch(float{});
  }
  return Status::invalid_argument("unknown dtype");
}

}  // namespace loom::ops
