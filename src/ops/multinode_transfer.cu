// Host side of the raw network exchange (kernels/tp/multinode/transfer.cuh) and of
// plan_multinode (the plan of any multi-node operator call).
#include <cuda_runtime_api.h>

#include <mutex>
#include <set>
#include <string>

#include "kernels/tp/multinode/transfer.cuh"
#include "ops/multinode.h"
#include "ops/launch/kernel_launch.h"
#include "ops/launch/queued_work.h"
#include "ops/multinode_common.h"

namespace loom::ops {

namespace kmn = kernels::tp::multinode;

Result<MultiNodePlan> plan_multinode(Communicator& comm, OpId op, const TpGemmArgs& args, const TpGemmOptions& options) {
  switch (op) {
    case OpId::kAgGemm: return plan_multinode_ag(comm, args, options);
    case OpId::kGemmRs:
    case OpId::kGemmAr: return mn::plan_multinode_reduce(comm, op, args, options);
    default: break;
  }
  return Status::invalid_argument("plan_multinode: " + std::string(op_name(op)) + " is not a multi-node operator");
}

Status net_exchange(Communicator& comm, const void* src, void* dst, size_t bytes, cudaStream_t stream, size_t chunk_bytes) {
  Communicator::Impl& impl = internal(comm);
  LOOM_TRY(impl.check_usable());
  if (!impl.network) return Status::unsupported("net_exchange: the communicator spans one node (no network)");
  if (bytes == 0) return Status::invalid_argument("net_exchange: zero bytes");
  if (chunk_bytes == 0) chunk_bytes = kmn::kTargetChunkBytes;
  LOOM_TRY(mn::load_multinode_kernels());
  const kmn::Grid g = mn::grid_of(impl);
  LOOM_ASSIGN_OR_RETURN(const uint64_t src_offset, impl.symmetric_offset(src, bytes, "net_exchange: src"));
  LOOM_ASSIGN_OR_RETURN(const uint64_t dst_offset,
                        impl.symmetric_offset(dst, bytes * (g.nodes - 1), "net_exchange: dst ((nodes - 1) x bytes)"));
  const uint64_t chunks = kmn::transfer_chunks(bytes, chunk_bytes);
  if (std::string why = mn::check_flags(impl, chunks * (g.nodes - 1)); !why.empty()) {
    return Status::unsupported("net_exchange of " + std::to_string(bytes) + " bytes in chunks of " + std::to_string(chunk_bytes) +
                               ": " + why);
  }
  if (mn::bytes_of(src, 1, static_cast<int64_t>(bytes), 1).overlaps(mn::bytes_of(dst, g.nodes - 1, static_cast<int64_t>(bytes), 1))) {
    return Status::invalid_argument("net_exchange: src overlaps dst");
  }
  kmn::TransferParams p{};
  p.comm = impl.device_comm();
  LOOM_ASSIGN_OR_RETURN(p.state, family_launch_state(impl, mn::kFamily));
  p.src_offset = src_offset;
  p.dst_offset = dst_offset;
  p.bytes = bytes;
  p.chunk_bytes = chunk_bytes;
  p.flag_base = impl.network->device_view().launch_flag_base;
  p.signature = mn::signature(OpId::kNetExchange, GemmTile::kAuto, g,
                              {static_cast<int64_t>(bytes), static_cast<int64_t>(chunk_bytes), static_cast<int64_t>(dst_offset)});
  return noted(comm, launch_kernel(&kmn::transfer_kernel, 1, 32, 0, stream, p), stream);
}

namespace mn {

Status load_multinode_kernels() {
  static std::mutex mu;
  static std::set<int> loaded;  // devices
  int device = 0;
  LOOM_CUDA_TRY(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  if (loaded.count(device) != 0) return {};
  LOOM_TRY(load_ag_gemm_kernels());
  LOOM_TRY(load_gemm_rs_kernels());
  LOOM_TRY(load_gemm_ar_kernels());
  LOOM_TRY(prepare_kernel(reinterpret_cast<const void*>(&kmn::transfer_kernel), 0));
  loaded.insert(device);
  return {};
}

}  // namespace mn

}  // namespace loom::ops
