// The raw network exchange (kernels/tp/multinode/transfer.cuh) and the loading of every
// multi-node kernel (multinode.h says why).
#include <cuda_runtime_api.h>

#include <string>

#include "kernels/tp/multinode/transfer.cuh"
#include "ops/launch/checks.h"
#include "ops/launch/family_resources.h"
#include "ops/launch/kernel_launch.h"
#include "ops/launch/queued_work.h"
#include "ops/tp/multinode/multinode.h"
#include "ops/tp/multinode/reduce.h"
#include "runtime/cuda_check.h"

namespace loom::ops {

namespace kmn = kernels::tp::multinode;

Status net_exchange(Communicator& comm, const void* src, void* dst, size_t bytes, cudaStream_t stream, size_t chunk_bytes) {
  Communicator::Impl& impl = internal(comm);
  LOOM_TRY(impl.check_usable());
  if (!impl.network) return Status::unsupported("net_exchange: the communicator spans one node (no network)");
  if (bytes == 0) return Status::invalid_argument("net_exchange: zero bytes");
  if (chunk_bytes == 0) chunk_bytes = kmn::kTargetChunkBytes;
  LOOM_TRY(tp::multinode::load_kernels());
  const kmn::Grid g = tp::multinode::grid_of(impl);
  LOOM_ASSIGN_OR_RETURN(const uint64_t src_offset, impl.symmetric_offset(src, bytes, "net_exchange: src"));
  LOOM_ASSIGN_OR_RETURN(const uint64_t dst_offset,
                        impl.symmetric_offset(dst, bytes * (g.nodes - 1), "net_exchange: dst ((nodes - 1) x bytes)"));
  const uint64_t flags = kmn::transfer_chunks(bytes, chunk_bytes) * (g.nodes - 1);
  const NetComm window = impl.network->device_view();
  const uint64_t capacity = window.flag_count - window.launch_flag_base;
  if (flags > capacity) {
    return Status::unsupported("net_exchange of " + std::to_string(bytes) + " bytes in chunks of " + std::to_string(chunk_bytes) +
                               ": it needs " + std::to_string(flags) + " network-window flags and the window holds " +
                               std::to_string(capacity) + " (fewer, larger chunks or a smaller call would fit)");
  }
  LOOM_TRY(check_disjoint("net_exchange", bytes_of(src, 1, static_cast<int64_t>(bytes), 1), "src",
                          bytes_of(dst, g.nodes - 1, static_cast<int64_t>(bytes), 1), "dst"));
  kmn::TransferParams p{};
  p.comm = impl.device_comm();
  LOOM_ASSIGN_OR_RETURN(p.state, family_launch_state(impl, tp::multinode::kFamily));
  p.src_offset = src_offset;
  p.dst_offset = dst_offset;
  p.bytes = bytes;
  p.chunk_bytes = chunk_bytes;
  p.flag_base = window.launch_flag_base;
  p.signature = tp::multinode::signature(OpId::kNetExchange, GemmTile::kAuto, g,
                                         {static_cast<int64_t>(bytes), static_cast<int64_t>(chunk_bytes),
                                          static_cast<int64_t>(dst_offset)});
  return noted(comm, launch_kernel(&kmn::transfer_kernel, 1, 32, 0, stream, p), stream);
}

namespace tp::multinode {

Status load_kernels() {
  return load_once_per_device([] {
    LOOM_TRY(load_ag_gemm_kernels());
    LOOM_TRY(load_reduce_kernels<false>());
    LOOM_TRY(load_reduce_kernels<true>());
    return prepare_kernel(reinterpret_cast<const void*>(&kmn::transfer_kernel), 0);
  });
}

}  // namespace tp::multinode

}  // namespace loom::ops
